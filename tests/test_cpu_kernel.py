"""The CPU expert kernel (quant/csrc/cpu_experts.c through quant/cpu_kernel.py, cpu_layer.py): per
format (MXFP4, dense bf16 / fp32 / fp16), token count (1, 2, 4, 7, 32) and instruction set (AVX-512,
AVX2, the portable loop: each where this CPU has it, else the next below), its products against the
torch dequantiser (MXFP4's is checked against gguf-py in test_mxfp4.py) times the activations in
float64; whole layers against fused_moe's torch path; the one-thread build; the fallback when no
compiler exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferryman.layers.fused_moe import MoEActivation, fused_moe
from ferryman.quant import cpu_kernel, get_format
from ferryman.quant.cpu_layer import LayerJob
from ferryman.quant.mxfp4 import dequant_mxfp4, random_mxfp4
from triton_interp import use_cpu_kernel

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler to build the CPU kernel")
ISAS = ["avx512bf16", "avx512", "avx2", "portable"]
TOKENS = [1, 2, 4, 7, 32]


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks, scales = random_mxfp4((n, k), torch.Generator().manual_seed(seed))
    scales[0, 0], scales[1, 0], scales[2, 0] = 0, 1, 150  # a subnormal, the smallest normal, a large scale
    return blocks, scales


def _reference(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (x.double() @ dequant_mxfp4(blocks, scales, torch.float32).double().T)


@needs_kernel
@pytest.mark.parametrize("k", [96, 320, 2880])  # no whole 4-group span; spans + 2 groups; gpt-oss's hidden size
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("isa", ISAS)
def test_mxfp4_matches_dequant_then_matmul(k: int, tokens: int, isa: str) -> None:
    blocks, scales = _weights(40, k, tokens)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1))
    want = _reference(x, blocks, scales)
    got = cpu_kernel.matmul(x, blocks, scales, isa=isa)
    assert got.shape == (tokens, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got.double()[:, 3:], want[:, 3:], rtol=1e-5, atol=1e-5)
    # rows 0-2 hold the extreme scales: each within 1e-5 of its own size
    torch.testing.assert_close(got.double()[:, :3] / want[:, :3].abs().amax(0), want[:, :3] / want[:, :3].abs().amax(0),
                               rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("k", [40, 2880])  # a masked tail; gpt-oss's hidden size
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("isa", ISAS)
def test_dense_matches_matmul(dtype: torch.dtype, k: int, tokens: int, isa: str) -> None:
    gen = torch.Generator().manual_seed(tokens)
    w = torch.randn(24, k, generator=gen).to(dtype)
    x = torch.randn(tokens, k, generator=gen)
    want = x.double() @ w.double().T
    got = cpu_kernel.matmul(x, w, fmt="dense", isa=isa)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("isa", ISAS)
def test_bf16_times_bf16_matches_matmul(tokens: int, isa: str) -> None:
    """bf16 weights times bf16 activations (vdpbf16ps where the CPU has AVX512-BF16, else the
    portable loop): the float64 product of the same bf16 values."""
    gen = torch.Generator().manual_seed(tokens)
    w = torch.randn(24, 2880, generator=gen).bfloat16()
    x = torch.randn(tokens, 2880, generator=gen).bfloat16().float()
    got = cpu_kernel.matmul(x, w, fmt="dense", isa=isa, x_bf16=True)
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("tokens", [3, 4, 5, 9])  # around the decoded tiles' threshold and register blocks
@pytest.mark.parametrize("fmt", ["mxfp4", "dense"])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_decoded_tiles_at_uneven_shapes(fmt: str, tokens: int, isa: str) -> None:
    """Several tokens per matrix decode each tile of rows once: 37 rows (not a whole number of tiles)
    and K = 2336 (two whole K tiles, then one that ends with MXFP4 groups after the last whole span),
    each product against the float64 reference."""
    n, k = 37, 2336
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, k, generator=gen)
    if fmt == "mxfp4":
        blocks, scales = _weights(n, k, tokens)
        got, want = cpu_kernel.matmul(x, blocks, scales, isa=isa), _reference(x, blocks, scales)
        got, want = got[:, 3:], want[:, 3:]  # rows 0-2: the extreme scales (test above)
    else:
        w = torch.randn(n, k, generator=gen).bfloat16()
        got, want = cpu_kernel.matmul(x, w, fmt="dense", isa=isa), x.double() @ w.double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_scale_255_doubles_like_the_reference() -> None:
    """s = 255 is 2^127 then x 2 (so zero codes stay 0, not NaN), as dequant_mxfp4 does."""
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    scales = torch.full((1, 1), 255, dtype=torch.uint8)
    x = torch.ones(1, 32)
    assert cpu_kernel.matmul(x, blocks, scales).item() == 0.0
    blocks[0, 0, 0] = 0x01  # one 0.5: 0.5 x 2^128 = 2^127, finite
    assert cpu_kernel.matmul(x, blocks, scales).item() == _reference(x, blocks, scales).item() == 2.0**127


def test_one_thread_build_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lib, how = cpu_kernel.build(openmp=False)
    if lib is None:
        pytest.skip(f"no build: {how}")
    assert "-fopenmp" not in how and lib.ferryman_cpu_has_openmp() == 0
    assert list((tmp_path / "ferryman").glob("cpu_experts-*.so"))  # kept in the cache directory
    blocks, scales = _weights(24, 320, 5)
    x = torch.randn(5, 320)
    got = cpu_kernel.matmul(x, blocks, scales, lib=lib)
    torch.testing.assert_close(got.double()[:, 3:], _reference(x, blocks, scales)[:, 3:], rtol=1e-5, atol=1e-5)


def test_no_compiler_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "ferryman-no-such-compiler")
    lib, how = cpu_kernel.build()
    assert lib is None and "ferryman-no-such-compiler" in how


def test_bad_inputs_name_the_tensor() -> None:
    blocks, scales = _weights(8, 64, 0)
    with pytest.raises(ValueError, match="x has K=32 inputs, the weights 64"):
        cpu_kernel.matmul(torch.zeros(1, 32), blocks, scales)
    with pytest.raises(ValueError, match="x must be a float32"):
        cpu_kernel.matmul(torch.zeros(1, 64, dtype=torch.bfloat16), blocks, scales)
    with pytest.raises(ValueError, match="scales must be uint8"):
        cpu_kernel.matmul(torch.zeros(1, 64), blocks, scales[:4])
    with pytest.raises(ValueError, match="no CPU kernel for dense weights of torch.int8"):
        cpu_kernel.matmul(torch.zeros(1, 64), torch.zeros(4, 64, dtype=torch.int8), fmt="dense")


@needs_kernel
@pytest.mark.parametrize("fmt", ["mxfp4", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_on_cpu_uses_the_kernel_and_matches_torch(fmt: str, dtype: torch.dtype,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss-style experts (bias, swiglu_oai) on the CPU, MXFP4 or dense (weights in x's dtype):
    through the kernel, the torch path's output within bf16 rounding, and the kernel is what ran."""
    form = get_format(fmt)
    banks = form.random_banks(6, 64, 96, True, dtype, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    ids = torch.tensor([[0, 3], [3, 5], [1, 0], [5, 2], [3, 4]])
    w = torch.rand(5, 2, generator=gen)
    act = MoEActivation("swiglu_oai")
    calls = [0]
    inner = LayerJob.run
    monkeypatch.setattr(LayerJob, "run", lambda job, *a: calls.__setitem__(0, calls[0] + 1) or inner(job, *a))
    fast = fused_moe(fmt, banks, x, ids, w, act)
    assert calls[0] == 1  # one kernel call for the layer
    use_cpu_kernel(monkeypatch, False)
    slow = fused_moe(fmt, banks, x, ids, w, act)
    assert calls[0] == 1
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, slow, **tol)


def _layer_banks(fmt: str, dtype: torch.dtype, bias: bool, seed: int) -> dict[str, torch.Tensor]:
    return get_format(fmt).random_banks(6, 128, 160, bias, dtype, torch.Generator().manual_seed(seed))


@needs_kernel
@pytest.mark.parametrize("fmt,dtype", [("mxfp4", torch.float32), ("dense", torch.bfloat16),
                                       ("dense", torch.float32), ("dense", torch.float16)])
@pytest.mark.parametrize("kind", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("isa", ISAS)
def test_layer_job_matches_fused_moe(fmt: str, dtype: torch.dtype, kind: str, tokens: int, isa: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Several experts of one layer in one call (both products and the activation in C, each expert
    on its own tokens, weighted and summed) against the torch path's fused_moe over the same pairs,
    computed in float64 from the same weights."""
    banks = _layer_banks(fmt, dtype, kind == "swiglu_oai", tokens)
    gen = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, 128, generator=gen) * 3  # some gates past the limit
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(tokens)])  # [T, 2]
    w = torch.rand(tokens, 2, generator=gen)
    act = MoEActivation(kind)
    got = LayerJob(x, banks, 0, cpu_kernel.pairs_of(ids, w), kind, act.alpha, act.limit, fmt=fmt).run(isa)
    use_cpu_kernel(monkeypatch, False)
    wide = {name: (b.double() if b.is_floating_point() else b) for name, b in banks.items()}
    want = fused_moe(fmt, wide, x.double(), ids, w.double(), act)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_many_pairs_take_numpy_and_give_the_same_job() -> None:
    """Past SMALL_PAIRS, pairs_of sorts with numpy (arrays per expert, tokens ascending); the layer job
    built from them equals the one built from the same pairs as lists, bit for bit."""
    gen = torch.Generator().manual_seed(21)
    t, k = 300, 4
    ids = torch.stack([torch.randperm(6, generator=gen)[:k] for _ in range(t)])  # 1,200 pairs of 6 experts
    w = torch.rand(t, k, generator=gen)
    assert ids.numel() > cpu_kernel.SMALL_PAIRS
    pairs = cpu_kernel.pairs_of(ids, w, [0, 2, 5, 9])
    for e in (0, 2, 5):
        rows = [r for r in range(t) if e in ids[r].tolist()]
        assert list(pairs[e][0]) == rows
        assert list(pairs[e][1]) == [w[r, ids[r].tolist().index(e)].item() for r in rows]
    assert len(pairs[9][0]) == 0
    banks = _layer_banks("mxfp4", torch.float32, True, 3)
    x = torch.randn(t, 128, generator=gen)
    pairs = cpu_kernel.pairs_of(ids, w)  # every expert of the 6
    as_lists = {e: (list(map(int, tk)), list(map(float, ws))) for e, (tk, ws) in pairs.items()}
    run = [LayerJob(x, banks, 0, p, "swiglu_oai", 1.702, 7.0).run() for p in (pairs, as_lists)]
    assert torch.equal(run[0], run[1])


@needs_kernel
def test_layer_job_keeps_bias_rows_and_checks_shapes() -> None:
    banks = _layer_banks("mxfp4", torch.float32, True, 11)
    x = torch.randn(4, 128)
    ids = torch.tensor([[0, 3], [3, 5], [1, 0], [5, 3]])
    w = torch.rand(4, 2)
    as_lists = {e: (list(t), list(ws)) for e, (t, ws) in cpu_kernel.pairs_of(ids, w, [0, 3, 4]).items()}
    assert as_lists == {0: ([0, 2], [w[0, 0].item(), w[2, 1].item()]),
                        3: ([0, 1, 3], [w[0, 1].item(), w[1, 0].item(), w[3, 1].item()]), 4: ([], [])}
    assert sorted(cpu_kernel.pairs_of(ids, w)) == [0, 1, 3, 5]  # every expert routed to
    pairs = cpu_kernel.pairs_of(ids, w, [0, 3])
    bias: dict = {}
    LayerJob(x, banks, 7, pairs, "swiglu_oai", 1.702, 7.0, bias).run()
    assert sorted(bias) == [(7, e, b) for e in (0, 3) for b in ("w13_bias", "w2_bias")]
    with pytest.raises(ValueError, match="activation must be one of"):
        LayerJob(x, banks, 0, pairs, "gelu", 1.0, 1.0)
    with pytest.raises(ValueError, match="does not match the experts' hidden size 128"):
        LayerJob(x[:, :32], banks, 0, pairs, "silu", 1.0, 1.0)
