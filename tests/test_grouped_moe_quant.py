"""grouped_moe (layers/grouped_moe_triton.py) on packed experts decoded inside its weight tiles: int4 /
int8 (group and channel scales, sym and asym, act-order group indices, odd group sizes), fp8 (block
scales of every tile relation, channel scales) and NVFP4 (both global-scale conventions), against
`fused_moe_reference` (each format's dequant + matmul; the dequantisers are checked against their
references in test_intq.py and test_fp8_nvfp4.py). Interpreter on CPU in a subprocess per family;
compiled on CUDA (gpu), at real layer shapes. And which prefill path each format takes (GGUF blocks:
always the batched one), and that the planner counts what that path dequantises."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moe_cases import check_cases, spy_prefill_paths
from triton_interp import run_interpreted

# Triton 3.6's interpreter multiplies bf16 tl.dot operands as raw integers: fp32/fp16 here, bf16 on the GPU.
# H 96 / I 64 with block_k 64: a partial K step; 18 pairs over 5 slots: partial and several blocks.
# Tile relations: a scale per row per tile (g128 / 128x128 blocks: BK 64 inside one group), a scale per
# run inside the tile (g32, 16x32 blocks), gathered per input (act order, g24, 32x48 partial blocks).
_FAMILIES = {
    "int": [("int4:g32:asym", "swiglu_oai", "float32", "strided", 96, 64),
            ("int4:g128:sym", "silu", "float16", "contiguous", 256, 128),
            ("int8:ch:asym", "silu", "float32", "contiguous", 96, 64),
            ("int4:g32:sym:act", "swiglu_oai", "float32", "strided", 96, 64),
            ("int8:g24:asym", "silu", "float32", "contiguous", 96, 48),
            ("int4:ch:sym", "silu", "float16", "strided", 96, 64)],
    "fp8": [("fp8:128x128", "silu", "float32", "contiguous", 256, 128),
            ("fp8:channel", "swiglu_oai", "float16", "strided", 96, 64),
            ("fp8:16x32", "silu", "float32", "contiguous", 96, 64),
            ("fp8:32x48", "swiglu_oai", "float32", "strided", 96, 64)],
    "nvfp4": [("nvfp4", "swiglu_oai", "float32", "strided", 96, 64),
              ("nvfp4-ct", "silu", "float32", "contiguous", 96, 64),
              ("nvfp4-ct", "swiglu_oai", "float16", "strided", 96, 64)],
}

_SCRIPT = """
import json, torch
from grouped_cases import Case, run_case
from ferryman.layers.grouped_moe_triton import GroupedConfig
cfg = GroupedConfig(block_m=16, block_n=32, block_k=64)
out = [run_case(Case(fmt, kind, getattr(torch, dt), layout, 5, h, i, 9, 2, cfg), "cpu", seed)
       for seed, (fmt, kind, dt, layout, h, i) in enumerate({cases!r})]
print(json.dumps(out))
"""

@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_grouped_moe_decodes_packed_tiles_in_interpreter(family: str) -> None:
    check_cases(json.loads(run_interpreted(_SCRIPT.format(cases=_FAMILIES[family])).strip().splitlines()[-1]))


@pytest.mark.parametrize("fmt, pairs, path", [
    ("int4:g128:sym", 2160, "grouped"), ("int4:g128:asym:act", 8192, "grouped"), ("int8:ch:sym", 8193, "batched"),
    ("fp8:128x128", 64, "grouped"), ("fp8:channel", 8192, "grouped"), ("fp8:16x32", 8193, "batched"),
    ("nvfp4", 100, "grouped"), ("nvfp4-ct", 6144, "grouped"), ("nvfp4", 6145, "batched"), ("nvfp4", None, "batched"),
    ("int4:g128:sym", None, "batched"), ("q4_k", 100, "batched"),
])
def test_prefill_path_of_packed_formats(fmt: str, pairs: int | None, path: str) -> None:
    """Packed experts the grouped GEMM reads take it up to their family's GROUPED_*_MAX_PAIRS (8192:
    qwen3-next's 216-token prefill, 2160 pairs of top-10, among them), the batched path above and
    with no count; formats it does not read always; the torch kernels never the grouped one."""
    pytest.importorskip("triton")
    from ferryman.layers import fused_moe as fm

    assert fm.prefill_path(fmt, pairs, "auto") == path
    assert fm.prefill_path(fmt, pairs, "torch") == "batched"
    family = fmt.partition(":")[0]
    limit = {"int4": fm.GROUPED_INT_MAX_PAIRS, "int8": fm.GROUPED_INT_MAX_PAIRS, "fp8": fm.GROUPED_FP8_MAX_PAIRS,
             "nvfp4": fm.GROUPED_NVFP4_MAX_PAIRS, "nvfp4-ct": fm.GROUPED_NVFP4_MAX_PAIRS}.get(family, 0)
    assert fm.grouped_max_pairs(fmt) == limit


@pytest.mark.parametrize("fmt", ["gguf:q4_k:q6_k", "gguf:q8_0:q8_0", "gguf:iq4_xs:mxfp4", "gguf:f16:bf16"])
@pytest.mark.parametrize("pairs", [0, 1, 65, 100, 2048, 4096, 4097, 8192, 32768, None])
def test_gguf_prefill_takes_the_batched_path_at_every_size(fmt: str, pairs: int | None) -> None:
    """The grouped GEMM does not read GGUF blocks (decoding them in its tiles measured slower than the
    batched path at every token count on the H200): every prefill batch, however small, takes the
    batched path, while the decode kernel still reads them."""
    pytest.importorskip("triton")
    from ferryman.layers import fused_moe as fm
    from ferryman.layers.moe_common import grouped_reads, triton_reads

    assert fm.prefill_path(fmt, pairs, "auto") == "batched"
    assert fm.prefill_path(fmt, pairs, "triton") == "batched"
    assert fm.grouped_max_pairs(fmt) == 0
    assert not grouped_reads(fmt) and triton_reads(fmt)


def test_grouped_moe_refuses_gguf_experts() -> None:
    """Called directly on GGUF banks, the grouped GEMM names the format instead of decoding them."""
    pytest.importorskip("triton")
    from ferryman.layers.grouped_moe_triton import grouped_moe
    from ferryman.layers.moe_common import MoEActivation
    from ferryman.quant import get_format

    fmt = "gguf:q4_k:q6_k"
    banks = get_format(fmt).random_banks(2, 256, 256, False, torch.float32, torch.Generator().manual_seed(0))
    x, ids, w = torch.zeros(1, 256), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    with pytest.raises(ValueError, match="no kernel for expert format 'gguf:q4_k:q6_k'"):
        grouped_moe(fmt, banks, x, ids, w, MoEActivation())


def test_planner_counts_a_batched_group_for_every_gguf_chunk() -> None:
    """activation_bytes follows prefill_path: a GGUF prefill chunk of any size dequantises a batched
    group's w13, where bf16 experts (the grouped GEMM) dequantise none."""
    pytest.importorskip("triton")
    from ferryman.config import QuantConfig
    from ferryman.layers.batched_moe import prefill_group
    from ferryman.models.registry import model_config
    from ferryman.planner import activation_bytes
    from ferryman.weights.presets import get_preset

    dense = model_config(get_preset("qwen3-30b-a3b"))
    packed = dataclasses.replace(dense, quant=QuantConfig("gguf:q4_k:q6_k"))
    h, i = dense.hidden_size, dense.moe_intermediate_size
    group_w13 = prefill_group(i, h, 2) * 2 * i * h * 2
    for tokens in (9, 512, 4096):  # 72, 4096, 32768 pairs of top-8
        got = activation_bytes(packed, torch.bfloat16, tokens, 1) - activation_bytes(dense, torch.bfloat16, tokens, 1)
        assert got == group_w13, tokens


@pytest.mark.parametrize("fmt", ["int4:g128:sym", "fp8:128x128", "nvfp4"])
def test_planner_counts_what_the_packed_path_dequantises(fmt: str) -> None:
    """activation_bytes asks prefill_path: a chunk within the grouped limit dequantises no expert (as
    bf16 experts, which always take the grouped GEMM), a larger one a batched group's w13."""
    pytest.importorskip("triton")
    from ferryman.config import QuantConfig
    from ferryman.layers.batched_moe import prefill_group
    from ferryman.layers.fused_moe import grouped_max_pairs
    from ferryman.models.registry import model_config
    from ferryman.planner import activation_bytes
    from ferryman.weights.presets import get_preset

    dense = model_config(get_preset("qwen3-30b-a3b"))
    packed = dataclasses.replace(dense, quant=QuantConfig(method=fmt.partition(":")[0], format=fmt))
    h, i, k = dense.hidden_size, dense.moe_intermediate_size, dense.top_k
    group_w13 = prefill_group(i, h, 2) * 2 * i * h * 2
    small, large = grouped_max_pairs(fmt) // k, grouped_max_pairs(fmt) // k + 1  # tokens per chunk
    for tokens, extra in ((small, 0), (large, group_w13)):
        got = activation_bytes(packed, torch.bfloat16, tokens, 1) - activation_bytes(dense, torch.bfloat16, tokens, 1)
        assert got == extra, (fmt, tokens)


def _gpu_cases(fmts: list[tuple[str, str, torch.dtype, int, int, int, int]], tokens: int) -> list[dict]:
    from grouped_cases import Case, run_case

    return [run_case(Case(fmt, "silu", dtype, layout, e, h, i, tokens, k), "cuda", seed)
            for seed, (fmt, layout, dtype, e, h, i, k) in enumerate(fmts)]


# qwen3-30b-a3b's layer (128 x (2048 x 768), top-8) and qwen3-next's (512 x (2048 x 512), top-10); bf16,
# and fp32 (exact products, tolerance 1e-5) for one member of each family
_BF16, _FP32 = torch.bfloat16, torch.float32
_QWEN3_30B = [(fmt, layout, dtype, 128, 2048, 768, 8) for fmt, layout, dtype in (
    ("int4:g128:sym", "strided", _BF16), ("int4:g128:asym", "contiguous", _BF16),
    ("int4:g128:asym", "strided", _FP32), ("int8:ch:sym", "contiguous", _BF16),
    ("int4:g128:sym:act", "strided", _BF16), ("fp8:128x128", "strided", _BF16), ("fp8:128x128", "contiguous", _FP32),
    ("fp8:channel", "contiguous", _BF16), ("nvfp4", "strided", _BF16), ("nvfp4-ct", "contiguous", _BF16),
    ("nvfp4-ct", "strided", _FP32))]
_QWEN3_NEXT = [(fmt, layout, _BF16, 512, 2048, 512, 10) for fmt, layout in (
    ("int4:g128:sym", "strided"), ("fp8:128x128", "contiguous"), ("nvfp4", "contiguous"))]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [5, 216])
def test_grouped_moe_packed_on_cuda_at_model_shapes(tokens: int) -> None:
    check_cases(_gpu_cases(_QWEN3_30B + _QWEN3_NEXT, tokens))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4:g128:sym", "fp8:128x128", "nvfp4"])
def test_cuda_packed_prefill_dispatch(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the defaults, fused_moe sends a packed prefill batch within the limit to the grouped GEMM,
    one past it to the batched path, and both equal the reference."""
    import ferryman.layers.fused_moe as fm
    from ferryman.layers.moe_common import MoEActivation
    from ferryman.layers.moe_reference import fused_moe_reference
    from ferryman.quant import get_format

    calls = spy_prefill_paths(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    form, act = get_format(fmt), MoEActivation("silu")
    banks = form.random_banks(8, 256, 128, False, torch.bfloat16, gen, "cuda")
    limit = fm.grouped_max_pairs(fmt)
    for t in (limit // 2, limit // 2 + 1):  # top-2
        x = torch.randn(t, 256, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(t, 8, device="cuda", generator=gen).topk(2, dim=-1).indices.to(torch.int32)
        w = torch.softmax(torch.randn(t, 2, device="cuda", generator=gen), -1)
        out = fm.fused_moe(fmt, banks, x, ids, w, act)
        ref = fused_moe_reference(form, banks, x, ids, w, act)
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 3e-2
    assert calls == ["grouped", "batched"]
