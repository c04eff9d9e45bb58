"""GGUF Triton kernels: the in-place dequantiser and the decode GEMV against the torch reference
(under the interpreter on CPU, compiled for sm_90 without a GPU, and on CUDA with @pytest.mark.gpu)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

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
        ours = dequant_gguf_rows(q, t, idx, torch.float32, block=128)
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
    ours = dequant_gguf_rows(banks[name], t, torch.tensor([2, 1]), torch.float32, block=512)
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
           "per_slot": "i64"}
    for code in TYPE_CODES.values():
        assert _compile("ferryman.quant.gguf_triton:_dequant_kernel", sig,
                        {"K": 512, "RB": 512, "T": code, "BLOCK": 1024, "HAS_IDX": 1})
