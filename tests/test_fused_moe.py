"""fused_moe: torch reference against transformers' expert modules; Triton kernels against the
reference (interpreter on CPU in a subprocess, compiled on CUDA with @pytest.mark.gpu)."""

from __future__ import annotations

import json

import pytest
import torch

from ferryman.layers.fused_moe import MoEActivation, fused_moe
from ferryman.layers.moe_reference import fused_moe_reference
from ferryman.quant import Banks, dequant_mxfp4, get_format
from ferryman.quant.dense import DenseFormat
from triton_interp import run_interpreted, use_cpu_kernel, use_kernels

transformers = pytest.importorskip("transformers")
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _routing(t: int, k: int, e: int, gen: torch.Generator, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token and softmax weights, like a router. -> ids [T, K], w [T, K] fp32."""
    ids = torch.stack([torch.randperm(e, generator=gen, device=device)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=gen, device=device), dim=-1)
    return ids, w


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _hf_config(cls: type, **kw: int) -> object:
    cfg = cls(**kw)
    cfg._experts_implementation = "eager"
    return cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["torch", "cpu-kernel"])
def test_reference_matches_transformers_gpt_oss(dtype: torch.dtype, cpu_kernel: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path rounds where transformers does (bf16: within 4e-3 of its max); the CPU MXFP4
    kernel computes each expert in fp32 and rounds once, so in bf16 it sits within 1.6e-2."""
    from ferryman.quant import cpu_kernel as kernel

    if cpu_kernel and not kernel.available():
        pytest.skip("no C compiler to build the CPU kernel")
    use_cpu_kernel(monkeypatch, cpu_kernel)
    e, h, i, t, k = 8, 128, 64, 7, 4
    gen = _gen(0)
    banks = get_format("mxfp4").random_banks(e, h, i, True, dtype, gen)
    hf = GptOssExperts(_hf_config(transformers.GptOssConfig, hidden_size=h, intermediate_size=i,
                                  num_local_experts=e, num_experts_per_tok=k)).to(dtype)
    with torch.no_grad():  # transformers keeps gpt-oss experts as [E, in, out]
        hf.gate_up_proj.copy_(dequant_mxfp4(banks["w13_blocks"], banks["w13_scales"], dtype).transpose(1, 2))
        hf.down_proj.copy_(dequant_mxfp4(banks["w2_blocks"], banks["w2_scales"], dtype).transpose(1, 2))
        hf.gate_up_proj_bias.copy_(banks["w13_bias"])
        hf.down_proj_bias.copy_(banks["w2_bias"])
    x = (torch.randn(t, h, generator=gen) * 4).to(dtype)  # large enough for the +-7 clamps to act
    ids, w = _routing(t, k, e, gen)
    w = w.to(dtype)  # gpt-oss's router softmax runs in the model dtype
    with torch.no_grad():
        ref = hf(x, ids, w)
    ours = fused_moe("mxfp4", banks, x, ids, w.float(), MoEActivation("swiglu_oai"))
    assert ours.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2 if cpu_kernel else 4e-3
    assert (ours.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["torch", "cpu-kernel"])
def test_reference_matches_transformers_qwen3_moe(dtype: torch.dtype, cpu_kernel: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense experts: the torch path within 4e-3 in bf16; the CPU kernel (fp32, one rounding) 1.6e-2."""
    from ferryman.quant import cpu_kernel as kernel

    if cpu_kernel and not kernel.available("dense", dtype):
        pytest.skip("no C compiler to build the CPU kernel")
    use_cpu_kernel(monkeypatch, cpu_kernel)
    e, h, i, t, k = 16, 96, 48, 9, 4
    gen = _gen(1)
    banks = get_format("dense").random_banks(e, h, i, False, dtype, gen)
    hf = Qwen3MoeExperts(_hf_config(transformers.Qwen3MoeConfig, hidden_size=h, moe_intermediate_size=i,
                                    num_experts=e, num_experts_per_tok=k)).to(dtype)
    with torch.no_grad():  # same [E, 2I, H] / [E, H, I] layout as our dense banks
        hf.gate_up_proj.copy_(banks["w13"])
        hf.down_proj.copy_(banks["w2"])
    x = torch.randn(t, h, generator=gen).to(dtype)
    ids, w = _routing(t, k, e, gen)
    w = w.to(dtype)  # Qwen3MoeTopKRouter casts the weights to the logits dtype
    with torch.no_grad():
        ref = hf(x, ids, w)
    ours = fused_moe("dense", banks, x, ids.int(), w.float(), MoEActivation("silu"))
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2 if cpu_kernel else 4e-3
    assert (ours.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


class _SpyDense(DenseFormat):
    """Records the expert ids of every dequant call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def dequant(self, banks: Banks, proj: str, idx: torch.Tensor | slice, dtype: torch.dtype | None = None) -> torch.Tensor:
        ids = list(range(idx.start, idx.stop)) if isinstance(idx, slice) else idx.tolist()
        self.calls.append((proj, ids))
        return super().dequant(banks, proj, idx, dtype)


def test_reference_dequantises_used_experts_one_at_a_time() -> None:
    spy = _SpyDense()
    banks = spy.random_banks(32, 64, 32, True, torch.float32, _gen(2))
    ids = torch.tensor([[7, 3], [3, 30], [7, 30], [3, 7]])
    x = torch.randn(4, 64, generator=_gen(3))
    fused_moe_reference(spy, banks, x, ids, torch.full((4, 2), 0.5), MoEActivation())
    assert spy.calls == [("w13", [3]), ("w2", [3]), ("w13", [7]), ("w2", [7]), ("w13", [30]), ("w2", [30])]


def test_reference_sums_weighted_experts_per_token() -> None:
    # one token, expert outputs combined by hand from the dequantised weights
    fmt = get_format("mxfp4")
    banks = fmt.random_banks(4, 64, 32, True, torch.float32, _gen(4))
    x = torch.randn(1, 64, generator=_gen(5))
    ids, w = torch.tensor([[2, 0]]), torch.tensor([[0.7, 0.3]])
    act = MoEActivation("silu")
    want = torch.zeros(64)
    for e, we in zip(ids[0].tolist(), w[0].tolist()):
        w13 = fmt.dequant(banks, "w13", torch.tensor([e]))[0]
        w2 = fmt.dequant(banks, "w2", torch.tensor([e]))[0]
        gu = w13 @ x[0] + banks["w13_bias"][e]
        want += we * (w2 @ (torch.nn.functional.silu(gu[:32]) * gu[32:]) + banks["w2_bias"][e])
    torch.testing.assert_close(fused_moe("mxfp4", banks, x, ids, w, act)[0], want, rtol=1e-5, atol=1e-5)


def test_fused_moe_rejects_bad_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    banks = get_format("dense").random_banks(4, 32, 16, False, torch.float32, _gen(6))
    x, ids, w = torch.randn(3, 32), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    act = MoEActivation()
    with pytest.raises(ValueError, match="x must be"):
        fused_moe("dense", banks, torch.randn(3, 31), ids, w, act)
    with pytest.raises(ValueError, match="topk_ids must be int32/int64"):
        fused_moe("dense", banks, x, ids.float(), w, act)
    with pytest.raises(ValueError, match="topk_w"):
        fused_moe("dense", banks, x, ids, torch.ones(3, 3), act)
    with pytest.raises(ValueError, match=r"out of range \[0, 4\)"):
        fused_moe("dense", banks, x, ids + 4, w, act)
    with pytest.raises(ValueError, match="unknown expert format 'int3'"):
        fused_moe("int3", banks, x, ids, w, act)
    with pytest.raises(ValueError, match="missing 'w13_blocks'"):
        fused_moe("mxfp4", banks, x, ids, w, act)
    with pytest.raises(ValueError, match="kind"):
        MoEActivation("gelu")
    from ferryman.errors import ConfigError

    with pytest.raises(ConfigError, match="FERRYMAN_KERNELS='cuda' is invalid"):
        use_kernels(monkeypatch, "cuda")


# Runs in a child process: TRITON_INTERPRET must be set before triton is first imported, and
# must not leak into this process (GPU tests here and elsewhere need compiled kernels).
_INTERP_SCRIPT = """
import json, torch
from moe_cases import random_routing, rel_err, slot_pool
from ferryman.layers.fused_moe_triton import BLOCK_K, BLOCK_N, fused_moe_decode
from ferryman.layers.moe_reference import fused_moe_reference
from ferryman.layers.moe_common import MoEActivation
from ferryman.quant import get_format
e, t, k = 4, 3, 2
# (H, I) per format: mxfp4 H = BLOCK_K + 32, two K steps, the second partial; dense H = 72 and
# I = 40 leave partial K steps and masked rows of the last BLOCK_N tile
dims = {"mxfp4": (BLOCK_K + 32, 64), "dense": (72, 40)}
assert 72 % BLOCK_N and 40 % BLOCK_N
out = []
for seed, (fmt, kind, dtype) in enumerate([
    ("dense", "silu", torch.float32), ("dense", "swiglu_oai", torch.bfloat16),
    ("mxfp4", "silu", torch.float16), ("mxfp4", "swiglu_oai", torch.float32), ("mxfp4", "swiglu_oai", torch.bfloat16),
]):  # each activation and each dtype at least once per format (the interpreter is slow: no full cross product)
    h, i = dims[fmt]
    gen = torch.Generator().manual_seed(seed)
    form = get_format(fmt)
    banks = form.random_banks(e, h, i, True, dtype, gen)
    x = (torch.randn(t, h, generator=gen) * 3).to(dtype)
    ids, w = random_routing(e, t, k, gen)
    act = MoEActivation(kind)
    ref = fused_moe_reference(form, banks, x, ids, w, act)
    strided = slot_pool(form, banks, h, i, True, dtype)  # the same experts in the expert-major slot pool
    layouts = [("strided", strided)] + ([("contiguous", banks)] if seed in (0, 2) else [])  # once per format
    for layout_name, bk in layouts:
        got = fused_moe_decode(fmt, bk, x, ids, w, kind, act.alpha, act.limit)
        out.append(dict(case=f"{fmt}-{kind}-{dtype}-{layout_name}", err=rel_err(got, ref), dtype=str(dtype),
                        dtype_ok=got.dtype == dtype and got.shape == x.shape))
print(json.dumps(out))
"""


# The interpreter casts fp32 -> bf16 by truncation (GPUs round to nearest), hence bf16's wider bound.
_INTERP_TOL = {"torch.float32": 1e-5, "torch.float16": 5e-3, "torch.bfloat16": 3e-2}


def test_triton_kernels_match_reference_in_interpreter() -> None:
    _check_interpreted(_INTERP_SCRIPT)


def _check_interpreted(script: str) -> None:
    """Run a case script under the interpreter; each case's relative error within its dtype's bound."""
    for case in json.loads(run_interpreted(script).strip().splitlines()[-1]):
        assert case["dtype_ok"], case
        assert case["err"] < _INTERP_TOL[case["dtype"]], case


# ---------------------------------------------------------------- CUDA ----------------------


def _gpt_oss_20b_layer(dtype: torch.dtype) -> Banks:
    return get_format("mxfp4").random_banks(32, 2880, 2880, True, dtype, _gen(10, "cuda"), "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_decode_gpt_oss_20b_shapes(t: int, dtype: torch.dtype) -> None:
    banks = _gpt_oss_20b_layer(dtype)
    gen = _gen(11, "cuda")
    x = torch.randn(t, 2880, generator=gen, device="cuda").to(dtype)
    ids, w = _routing(t, 4, 32, gen, "cuda")
    act = MoEActivation("swiglu_oai")
    got = fused_moe("mxfp4", banks, x, ids.int(), w, act)  # Triton: CUDA, 4t pairs
    ref = fused_moe_reference(get_format("mxfp4"), banks, x, ids, w, act)
    assert got.dtype == dtype
    assert _rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@gpu
def test_gpu_decode_dense_qwen3_shapes() -> None:
    fmt = get_format("dense")
    banks = fmt.random_banks(16, 2048, 768, False, torch.bfloat16, _gen(12, "cuda"), "cuda")
    gen = _gen(13, "cuda")
    x = torch.randn(2, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = _routing(2, 8, 16, gen, "cuda")
    got = fused_moe("dense", banks, x, ids, w, MoEActivation("silu"))
    assert _rel_err(got, fused_moe_reference(fmt, banks, x, ids, w, MoEActivation("silu"))) < 1e-2


@pytest.mark.gpu
@gpu
def test_gpu_decode_is_graph_capturable() -> None:
    banks = _gpt_oss_20b_layer(torch.bfloat16)
    gen = _gen(14, "cuda")
    x = torch.randn(1, 2880, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = _routing(1, 4, 32, gen, "cuda")
    act = MoEActivation("swiglu_oai")
    fused_moe("mxfp4", banks, x, ids, w, act)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe("mxfp4", banks, x, ids, w, act)
    new_ids, new_w = _routing(1, 4, 32, gen, "cuda")
    ids.copy_(new_ids)
    w.copy_(new_w)
    x.copy_(torch.randn(1, 2880, generator=gen, device="cuda"))
    graph.replay()
    ref = fused_moe_reference(get_format("mxfp4"), banks, x, ids, w, act)
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@gpu
def test_gpu_prefill_agrees_with_forced_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """FERRYMAN_KERNELS=triton takes the decode kernel for a prefill-sized batch too."""
    banks = _gpt_oss_20b_layer(torch.bfloat16)
    gen = _gen(15, "cuda")
    x = torch.randn(40, 2880, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = _routing(40, 4, 32, gen, "cuda")  # 160 pairs: the grouped prefill path
    act = MoEActivation("swiglu_oai")
    ref = fused_moe("mxfp4", banks, x, ids, w, act)
    use_kernels(monkeypatch, "triton")
    assert _rel_err(fused_moe("mxfp4", banks, x, ids, w, act), ref) < 1e-2


def test_cpu_decode_paths_match_reference_for_big_dense_experts() -> None:
    """Few pairs on CPU: big dense experts are multiplied in place (bank views), small ones gathered."""
    from ferryman.layers import moe_reference as ref_mod

    form = get_format("dense")
    gen = torch.Generator().manual_seed(3)
    banks = form.random_banks(8, 1024, 512, False, torch.float32, gen)  # 4 MiB per w13: in place
    assert banks["w13"][0].numel() * 4 >= ref_mod.IN_PLACE_MIN_BYTES
    x = torch.randn(2, 1024, generator=gen)
    ids = torch.tensor([[1, 5], [2, 5]])
    w = torch.softmax(torch.randn(2, 2, generator=gen), -1)
    act = MoEActivation("silu")
    ref = fused_moe_reference(form, banks, x, ids, w, act)
    for got in (ref_mod.fused_moe_gathered(form, banks, x, ids, w, act), fused_moe("dense", banks, x, ids, w, act)):
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("dtype, tokens, path", [
    (torch.float32, 2, "gathered"), (torch.float32, 8, "gathered"), (torch.float32, 9, "reference"),
    (torch.float32, 64, "reference"), (torch.bfloat16, 16, "gathered"), (torch.bfloat16, 17, "reference"),
])
def test_cpu_gathers_only_while_each_expert_is_copied_a_few_times(dtype: torch.dtype, tokens: int, path: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU, small dense experts, without the C kernel (no compiler, FERRYMAN_KERNELS=torch): the
    gathered path copies an expert once per pair, so it serves a batch only while pairs <= 2 (fp32)
    or 4 (bf16) x the distinct experts; both paths equal the reference."""
    from ferryman.layers import fused_moe as fm

    use_cpu_kernel(monkeypatch, False)

    form = get_format("dense")
    gen = torch.Generator().manual_seed(4)
    banks = form.random_banks(8, 64, 32, False, dtype, gen)
    x = torch.randn(tokens, 64, generator=gen).to(dtype)
    t = torch.arange(tokens)
    ids = torch.stack([t % 8, (t % 8 + 1 + (t // 8) % 7) % 8], dim=1)  # [T, 2], distinct; 8 experts from 8 tokens on
    w = torch.softmax(torch.randn(tokens, 2, generator=gen), -1)
    act = MoEActivation("silu")
    taken: list[str] = []
    real_gathered, real_reference = fm.fused_moe_gathered, fm.fused_moe_reference
    monkeypatch.setattr(fm, "fused_moe_gathered", lambda *a, **k: taken.append("gathered") or real_gathered(*a, **k))
    monkeypatch.setattr(fm, "fused_moe_reference", lambda *a, **k: taken.append("reference") or real_reference(*a, **k))
    got = fused_moe("dense", banks, x, ids, w, act).float()
    assert taken == [path]
    ref = real_reference(form, banks, x, ids, w, act).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - ref).abs().max() <= tol * ref.abs().max()
