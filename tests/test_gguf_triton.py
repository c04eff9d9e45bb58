"""GGUF Triton kernels: the in-place dequantiser and the decode GEMV against the torch reference
(under the interpreter on CPU, compiled for sm_90 without a GPU, and on CUDA with @pytest.mark.gpu)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from moe_cases import spy_prefill_paths
from triton_interp import run_interpreted

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

_DEQUANT = """
import torch
from ferryman.quant.gguf_blocks import GGUF_TYPES, BLOCK_SIZES, dequant_rows, row_bytes
from ferryman.quant.gguf_triton import dequant_gguf_rows
from ferryman.quant.layout import ExpertLayout
from ferryman.quant import gguf_format
g = torch.Generator().manual_seed(5)
for t in GGUF_TYPES:  # every byte value: random bytes, NaN/inf scales included
    bs = BLOCK_SIZES[t][0]
    k = 2 * bs if bs > 1 else 48
    q = torch.randint(0, 256, (4, 3, row_bytes(t, k)), generator=g, dtype=torch.uint8)
    for idx in (slice(1, 3), torch.tensor([3, 0, 3]), slice(2, 2)):
        ours = dequant_gguf_rows(q, t, idx, torch.float32, rows_per_program=2)  # a ragged last program
        want = dequant_rows(q[idx], t)
        nan = want.isnan()
        assert ours.shape == want.shape and torch.equal(ours.isnan(), nan), t
        assert torch.equal(ours[~nan].view(torch.int32), want[~nan].view(torch.int32)), t
# strided slots (the expert-major pool's views); bf16 is checked on the GPU (the interpreter
# rounds fp32 -> bf16 its own way)
fmt = gguf_format("q4_k", "q6_k")
layout = ExpertLayout.of(fmt.bank_specs(3, 256, 256, False, torch.bfloat16))
flat = torch.zeros(3, layout.row_bytes, dtype=torch.uint8)
banks = layout.views(flat)
src = fmt.random_banks(3, 256, 256, False, torch.bfloat16, g)
for name in ("w13_q", "w2_q"):
    banks[name].copy_(src[name])
    assert not banks[name].is_contiguous()
    t = fmt.types[name[:-2]]
    ours = dequant_gguf_rows(banks[name], t, torch.tensor([2, 1]), torch.float32)
    assert torch.equal(ours, dequant_rows(src[name][[2, 1]], t)), name
print("ok")
"""


def test_triton_dequant_equals_reference_on_every_type() -> None:
    """Every type, random bytes, by slice and index tensor (repeats, empty), strided slots."""
    assert run_interpreted(_DEQUANT).strip().endswith("ok")


def _compile(qualname: str, sig: dict[str, str], constexprs: dict) -> str:
    from triton_compile_check import compile_check

    try:
        return compile_check(qualname, sig, constexprs)
    except (ImportError, RuntimeError) as e:  # no NVIDIA backend in this triton build
        if "backend" in str(e).lower():
            pytest.skip(str(e))
        raise


def test_dequant_kernel_compiles_for_sm90_for_every_type() -> None:
    from ferryman.quant.gguf_triton import TYPE_CODES

    sig = {"q_ptr": "*u8", "idx_ptr": "*i64", "out_ptr": "*bf16", "slot0": "i64", "slot_stride": "i64",
           "out_rows": "i32"}
    for code in TYPE_CODES.values():
        assert _compile("ferryman.quant.gguf_triton:_dequant_kernel", sig,
                        {"K": 2048, "ROWS": 16, "T": code, "HAS_IDX": 1})


_DECODE = """
import json, torch
from ferryman.layers.fused_moe_triton import fused_moe_decode
from ferryman.layers.moe_common import MoEActivation
from ferryman.layers.moe_reference import fused_moe_reference
from ferryman.quant import get_format
from moe_cases import random_routing, rel_err, slot_pool
e, t, k = 4, 2, 2
out = []
for seed, (fmt, kind, dtype, h, i) in enumerate([  # Q4_K_M, Q5_K_M, Q8_0 mixes; I not a multiple of BLOCK_N
    ("gguf:q4_k:q6_k", "silu", torch.float32, 256, 512), ("gguf:q5_k:q8_0", "silu", torch.float16, 256, 288),
    ("gguf:q8_0:q4_k", "swiglu_oai", torch.float32, 96, 256),
]):
    gen = torch.Generator().manual_seed(seed)
    form = get_format(fmt)
    bias = kind == "swiglu_oai"
    banks = form.random_banks(e, h, i, bias, dtype, gen)
    x = (torch.randn(t, h, generator=gen) * 3).to(dtype)
    ids, w = random_routing(e, t, k, gen)
    act = MoEActivation(kind)
    ref = fused_moe_reference(form, banks, x, ids, w, act)
    bk = slot_pool(form, banks, h, i, bias, dtype) if seed == 0 else banks
    got = fused_moe_decode(fmt, bk, x, ids, w, kind, act.alpha, act.limit)
    out.append(dict(case=fmt, err=rel_err(got, ref), dtype=str(dtype),
                    dtype_ok=got.dtype == dtype and got.shape == x.shape))
print(json.dumps(out))
"""


def test_decode_kernels_match_reference_in_interpreter() -> None:
    """The decode GEMVs reading GGUF blocks (strided slot pool included) against fused_moe's torch
    reference on the same banks: fp32 within 1e-5, fp16 within 5e-3."""
    for case in json.loads(run_interpreted(_DECODE).strip().splitlines()[-1]):
        assert case["dtype_ok"], case
        assert case["err"] < {"torch.float32": 1e-5, "torch.float16": 5e-3}[case["dtype"]], case


@pytest.mark.parametrize("types", [("q4_k", "q6_k"), ("q5_k", "q8_0"), ("iq4_xs", "mxfp4")])
def test_decode_kernels_compile_for_sm90(types: tuple[str, str]) -> None:
    """The decode GEMVs at qwen3-30b-a3b's expert shapes (H 2048, I 768), bf16 activations."""
    from ferryman.layers import fused_moe_triton as fmt
    from ferryman.quant.gguf_blocks import row_bytes
    from ferryman.quant.gguf_triton import type_code

    h, i = 2048, 768
    st13, st2 = 2 * i * row_bytes(types[0], h), h * row_bytes(types[1], i)
    # QF 0: no fp8 / nvfp4 / int branch; g_ptr, z_ptr: the weights again, unread
    common = {"MXFP4": False, "HAS_BIAS": False, "BLOCK_N": fmt.BLOCK_N, "BLOCK_K": fmt.BLOCK_K, "H": h, "I": i,
              "B_STRIDE": 0, "G_STRIDE": 0, "Z_STRIDE": 0, "QF": 0, "QA": 0, "QB": 0, "HOST": True}
    sig13 = {"x_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8", "g_ptr": "*u8", "b_ptr": "*bf16",
             "h_ptr": "*bf16", "alpha": "fp32", "limit": "fp32", "z_ptr": "*u8", "host_ptr": "*i64"}
    assert _compile("ferryman.layers.fused_moe_triton:_w13_act_kernel", sig13,
                    {**common, "W_STRIDE": st13, "S_STRIDE": st13, "TOPK": 8, "ACT": 0, "GGUF": type_code(types[0])})
    sig2 = {"h_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8", "g_ptr": "*u8", "b_ptr": "*bf16",
            "topk_w_ptr": "*fp32", "y_ptr": "*fp32", "z_ptr": "*u8", "host_ptr": "*i64"}
    assert _compile("ferryman.layers.fused_moe_triton:_w2_kernel", sig2,
                    {**common, "W_STRIDE": st2, "S_STRIDE": st2, "GGUF": type_code(types[1])})


# ---------------------------------------------------------------- CUDA ----------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit where not NaN, NaN at the same places."""
    nan = b.isnan()
    return torch.equal(a.isnan(), nan) and torch.equal(a[~nan].float().view(torch.int32),
                                                       b[~nan].float().view(torch.int32))


@pytest.mark.gpu
@gpu
def test_gpu_dequant_equals_reference_on_every_type() -> None:
    """Random bytes of every type on the GPU: the Triton dequantiser = the torch reference (on CUDA
    and on the CPU), fp32 and bf16, rows read in place from the slots asked for."""
    from ferryman.quant.gguf_blocks import BLOCK_SIZES, GGUF_TYPES, dequant_rows, row_bytes
    from ferryman.quant.gguf_triton import dequant_gguf_rows

    gen = torch.Generator(device="cuda").manual_seed(3)
    idx = torch.tensor([5, 0, 5, 7], device="cuda")
    for t in GGUF_TYPES:
        k = 1024 if BLOCK_SIZES[t][0] > 1 else 384
        q = torch.randint(0, 256, (8, 512, row_bytes(t, k)), generator=gen, dtype=torch.uint8, device="cuda")
        want = dequant_rows(q[idx], t)
        assert _same(want.cpu(), dequant_rows(q.cpu()[idx.cpu()], t)), t
        assert _same(dequant_gguf_rows(q, t, idx, torch.float32), want), t
        assert _same(dequant_gguf_rows(q, t, idx, torch.bfloat16), want.to(torch.bfloat16)), t
        assert _same(dequant_gguf_rows(q, t, slice(2, 5), torch.float16), dequant_rows(q[2:5], t).half()), t


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["gguf:q4_k:q6_k", "gguf:q4_k:q4_k", "gguf:q5_k:q8_0", "gguf:iq4_xs:q5_0"])
def test_gpu_fused_moe_at_qwen3_30b_shapes(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode (Triton GEMVs, 1 and 4 tokens) and prefill (batched, Triton dequantiser; never the
    grouped GEMM) on a qwen3-30b-a3b-sized layer against the torch reference on the same banks."""
    from ferryman.layers.fused_moe import MoEActivation, fused_moe
    from ferryman.layers.moe_reference import fused_moe_reference
    from ferryman.quant import get_format

    form = get_format(fmt)
    gen = torch.Generator(device="cuda").manual_seed(4)
    banks = form.random_banks(128, 2048, 768, False, torch.bfloat16, gen, "cuda")
    act = MoEActivation("silu")
    calls = spy_prefill_paths(monkeypatch)
    for t in (1, 4, 40):  # 8, 32 pairs: decode kernels; 320: the batched path
        x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(128, generator=gen, device="cuda")[:8] for _ in range(t)])
        w = torch.softmax(torch.randn(t, 8, generator=gen, device="cuda"), -1)
        got = fused_moe(fmt, banks, x, ids.int(), w, act)
        ref = fused_moe_reference(form, banks, x, ids, w, act)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert got.dtype == torch.bfloat16 and err < 1e-2, (t, err)
    assert calls == ["batched"]


@pytest.mark.gpu
@gpu
def test_gpu_decode_is_graph_capturable() -> None:
    """The GGUF decode GEMVs read slot ids on the device: one capture replays for new ids."""
    from ferryman.layers.fused_moe_triton import fused_moe_decode
    from ferryman.quant import get_format

    fmt = "gguf:q4_k:q6_k"
    gen = torch.Generator(device="cuda").manual_seed(5)
    banks = get_format(fmt).random_banks(128, 2048, 768, False, torch.bfloat16, gen, "cuda")
    x = torch.randn(1, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    ids = torch.randperm(128, generator=gen, device="cuda")[:8].view(1, 8).int()
    w = torch.softmax(torch.randn(1, 8, generator=gen, device="cuda"), -1)

    def call() -> torch.Tensor:
        return fused_moe_decode(fmt, banks, x, ids, w, "silu", 1.702, 7.0)

    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    ids.copy_(torch.randperm(128, generator=gen, device="cuda")[:8].view(1, 8))
    graph.replay()
    assert torch.equal(out, call())
