"""The CPU MXFP4 kernel (quant/csrc/mxfp4_cpu.c through quant/mxfp4_cpu.py): its products against
the torch dequantiser (checked against gguf-py in test_mxfp4.py) times the activations in float64,
for its AVX-512 path, its portable loop and a build without -march=native; the experts of
fused_moe on the CPU through it against the torch path; and the fallback when no compiler exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferryman.layers.fused_moe import MoEActivation, fused_moe
from ferryman.quant import get_format
from ferryman.quant import mxfp4_cpu
from ferryman.quant.mxfp4 import dequant_mxfp4, random_mxfp4
from triton_interp import set_read_once, use_cpu_kernel

needs_kernel = pytest.mark.skipif(not mxfp4_cpu.available(), reason="no C compiler to build the CPU kernel")


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks, scales = random_mxfp4((n, k), torch.Generator().manual_seed(seed))
    scales[0, 0], scales[1, 0], scales[2, 0] = 0, 1, 150  # a subnormal, the smallest normal, a large scale
    return blocks, scales


def _reference(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (x.double() @ dequant_mxfp4(blocks, scales, torch.float32).double().T)


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 6, 8, 9, 17])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable-loop"])
def test_kernel_matches_dequant_then_matmul(tokens: int, portable: bool) -> None:
    blocks, scales = _weights(40, 96, tokens)
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(1))
    want = _reference(x, blocks, scales)
    got = mxfp4_cpu.mxfp4_matmul(x, blocks, scales, portable=portable)
    assert got.shape == (tokens, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got.double()[:, 3:], want[:, 3:], rtol=1e-5, atol=1e-6)
    # rows 0-2 hold the extreme scales: each within 1e-5 of its own size
    torch.testing.assert_close(got.double()[:, :3] / want[:, :3].abs().amax(0), want[:, :3] / want[:, :3].abs().amax(0),
                               rtol=1e-5, atol=1e-5)


@needs_kernel
def test_scale_255_doubles_like_the_reference() -> None:
    """s = 255 is 2^127 then x 2 (so zero codes stay 0, not NaN), as dequant_mxfp4 does."""
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    scales = torch.full((1, 1), 255, dtype=torch.uint8)
    x = torch.ones(1, 32)
    assert mxfp4_cpu.mxfp4_matmul(x, blocks, scales).item() == 0.0
    blocks[0, 0, 0] = 0x01  # one 0.5: 0.5 x 2^128 = 2^127, finite
    assert mxfp4_cpu.mxfp4_matmul(x, blocks, scales).item() == _reference(x, blocks, scales).item() == 2.0**127


def test_build_without_native_flags_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    set_read_once(monkeypatch, "CACHE_DIR", str(tmp_path))
    lib, how = mxfp4_cpu.build(portable_only=True)
    if lib is None:
        pytest.skip(f"no build: {how}")
    assert "-march=native" not in how and lib.ferryman_mxfp4_has_avx512() in (0, 1)
    assert list(tmp_path.glob("mxfp4_cpu-*.so"))  # kept in the cache directory
    blocks, scales = _weights(24, 64, 5)
    x = torch.randn(5, 64)
    got = mxfp4_cpu.mxfp4_matmul(x, blocks, scales, lib=lib)
    torch.testing.assert_close(got.double()[:, 3:], _reference(x, blocks, scales)[:, 3:], rtol=1e-5, atol=1e-6)


def test_no_compiler_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "ferryman-no-such-compiler")
    lib, how = mxfp4_cpu.build()
    assert lib is None and "ferryman-no-such-compiler" in how


def test_bad_inputs_name_the_tensor() -> None:
    blocks, scales = _weights(8, 64, 0)
    with pytest.raises(ValueError, match="x has K=32 inputs, the weights 64"):
        mxfp4_cpu.mxfp4_matmul(torch.zeros(1, 32), blocks, scales)
    with pytest.raises(ValueError, match="x must be a float32"):
        mxfp4_cpu.mxfp4_matmul(torch.zeros(1, 64, dtype=torch.bfloat16), blocks, scales)
    with pytest.raises(ValueError, match="scales must be uint8"):
        mxfp4_cpu.mxfp4_matmul(torch.zeros(1, 64), blocks, scales[:4])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_on_cpu_uses_the_kernel_and_matches_torch(dtype: torch.dtype,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss-style experts (bias, swiglu_oai) on the CPU: through the kernel, the torch path's
    output within bf16 rounding, and the kernel is what ran."""
    form = get_format("mxfp4")
    banks = form.random_banks(6, 64, 96, True, dtype, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    ids = torch.tensor([[0, 3], [3, 5], [1, 0], [5, 2], [3, 4]])
    w = torch.rand(5, 2, generator=gen)
    act = MoEActivation("swiglu_oai")
    calls = [0]
    inner = mxfp4_cpu.LayerJob.run
    monkeypatch.setattr(mxfp4_cpu.LayerJob, "run", lambda job, *a: calls.__setitem__(0, calls[0] + 1) or inner(job, *a))
    fast = fused_moe("mxfp4", banks, x, ids, w, act)
    assert calls[0] == 1  # one kernel call for the layer
    use_cpu_kernel(monkeypatch, False)
    slow = fused_moe("mxfp4", banks, x, ids, w, act)
    assert calls[0] == 1
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, slow, **tol)


@needs_kernel
@pytest.mark.parametrize("kind", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable-loop"])
def test_expert_in_one_call_matches_the_torch_expert(kind: str, bias: bool, portable: bool) -> None:
    """One expert through LayerJob (both products and the activation in C) against the torch
    path's expert in float32: dequantise, matmul, bias, apply_activation, matmul, bias."""
    from ferryman.layers.moe_common import apply_activation
    from ferryman.layers.moe_reference import project

    form = get_format("mxfp4")
    banks = form.random_banks(3, 64, 96, bias, torch.float32, torch.Generator().manual_seed(7))
    act = MoEActivation(kind)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(8)) * 3  # some gates past the limit
    gate_up = project(form, banks, "w13", 1, x)
    if bias:
        gate_up = gate_up + banks["w13_bias"][1]
    want = project(form, banks, "w2", 1, apply_activation(gate_up, act))
    if bias:
        want = want + banks["w2_bias"][1]
    pairs = {1: (list(range(9)), [1.0] * 9)}
    got = mxfp4_cpu.LayerJob(x, banks, 0, pairs, kind, act.alpha, act.limit).run(portable=portable)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="activation must be one of"):
        mxfp4_cpu.LayerJob(x, banks, 0, pairs, "gelu", 1.0, 1.0)
    with pytest.raises(ValueError, match="x has K=32 inputs, the weights 64"):
        mxfp4_cpu.LayerJob(x[:, :32], banks, 0, pairs, kind, act.alpha, act.limit)


@needs_kernel
def test_layer_job_sums_the_experts_like_fused_moe(monkeypatch: pytest.MonkeyPatch) -> None:
    """One kernel call for several experts, each on its own tokens, weighted and summed: the torch
    path's fused_moe over the same pairs (float32), and the bias rows cached by (layer, expert)."""
    form = get_format("mxfp4")
    banks = form.random_banks(6, 64, 96, True, torch.float32, torch.Generator().manual_seed(11))
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(4, 64, generator=gen)
    ids = torch.tensor([[0, 3], [3, 5], [1, 0], [5, 3]])
    w = torch.rand(4, 2, generator=gen)
    pairs = mxfp4_cpu.pairs_of(ids, w, [0, 3])
    assert pairs == {0: ([0, 2], [w[0, 0].item(), w[2, 1].item()]),
                     3: ([0, 1, 3], [w[0, 1].item(), w[1, 0].item(), w[3, 1].item()])}
    bias: dict = {}
    got = mxfp4_cpu.LayerJob(x, banks, 7, pairs, "swiglu_oai", 1.702, 7.0, bias).run()
    assert sorted(bias) == [(7, e, b) for e in (0, 3) for b in ("w13_bias", "w2_bias")]
    use_cpu_kernel(monkeypatch, False)
    keep = torch.isin(ids, torch.tensor([0, 3]))
    want = fused_moe("mxfp4", banks, x, ids, w.masked_fill(~keep, 0.0), MoEActivation("swiglu_oai"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got[2].abs().sum() > 0  # token 2 reached expert 0 through its second pair
