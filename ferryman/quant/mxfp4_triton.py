"""Triton dequantisation of `mxfp4` weights: exactly what `dequant_mxfp4` (quant/mxfp4.py) returns,
in one launch and without a host sync. The power of two is built from its bits, not `exp2`, so it
is exact: s in 1..254 is the normal fp32 with exponent field s, s = 0 the subnormal 2^-127, s = 255
is 2^127 then x 2, as the reference does it. `mxfp4_tile` is the grouped prefill GEMM's weight tile
(layers/grouped_moe_triton.py); it reads scale 0 as 0 and 255 as inf (never in real checkpoints).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferryman.quant.bank_slots import program_slot, rows_contiguous, slot_span

BLOCK_BYTES = 16  # bytes per 32-value scale group
_BB = tl.constexpr(BLOCK_BYTES)  # the same, as kernels may read it (plain globals do not compile)
_BV = tl.constexpr(2 * BLOCK_BYTES)  # values per scale group


@triton.jit
def _e2m1_value(code):
    # 4-bit code -> fp32: sign bit 3, exponent bits 2..1, mantissa bit 0; e = 0 is 0 or 0.5
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    pow2 = (1 << tl.maximum(e - 1, 0)).to(tl.float32)  # 1, 2, 4 for e = 1, 2, 3
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)
    return tl.where((code >> 3) == 1, -mag, mag)


@triton.jit
def _scale_value(s):
    # e8m0 byte (int32) -> 2^(min(s, 254) - 127) exactly; the caller doubles s = 255
    bits = tl.where(s == 0, 1 << 22, tl.minimum(s, 254) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequant_kernel(blocks_ptr, scales_ptr, idx_ptr, out_ptr, slot0, groups_per_row, blocks_row_stride,
                    scales_row_stride, GROUPS: tl.constexpr, HAS_IDX: tl.constexpr):
    # program (p, r): scale groups p*GROUPS .. +GROUPS of bank row (expert slot) idx[r] (HAS_IDX)
    # or slot0 + r -> output row r. A row's [groups, 16] bytes and [groups] scales are contiguous;
    # rows are blocks_row_stride / scales_row_stride apart (strided slot pools included).
    r, slot = program_slot(idx_ptr, slot0, HAS_IDX)
    g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
    gmask = g < groups_per_row
    j = tl.arange(0, _BB)  # byte within a group
    src = blocks_ptr + slot * blocks_row_stride + g[:, None] * _BB + j[None, :]
    byte = tl.load(src, mask=gmask[:, None], other=0).to(tl.int32)  # [GROUPS, 16]
    s = tl.load(scales_ptr + slot * scales_row_stride + g, mask=gmask, other=127).to(tl.int32)
    scale = _scale_value(s)[:, None]
    twice = (s == 255)[:, None]
    lo = _e2m1_value(byte & 0xF) * scale  # element 2j
    hi = _e2m1_value(byte >> 4) * scale  # element 2j + 1
    lo = tl.where(twice, lo * 2.0, lo)
    hi = tl.where(twice, hi * 2.0, hi)
    # interleave in registers, then one contiguous store per group (coalesced, vectorised)
    vals = tl.reshape(tl.join(lo, hi), (GROUPS, _BV))  # [GROUPS, 32]: lo0 hi0 lo1 hi1 ...
    k = tl.arange(0, _BV)
    dst = out_ptr + (r.to(tl.int64) * groups_per_row + g[:, None]) * _BV + k[None, :]
    tl.store(dst, vals.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


GROUPS_PER_PROGRAM = 128


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[-1] != BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks = scales.shape + ({BLOCK_BYTES},))")


def dequant_mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor | slice,
                       dtype: torch.dtype, groups_per_program: int = GROUPS_PER_PROGRAM) -> torch.Tensor:
    """Rows `idx` of banks blocks [E, ..., G, 16] + scales [E, ..., G] -> [n, ..., G*32] in `dtype`,
    read in place: no gather of the packed rows first (one launch). idx: a step-1 slice or a 1-D
    integer tensor on the banks' device. Banks whose rows are not contiguous inside are gathered."""
    _check(blocks, scales)
    stepped = isinstance(idx, slice) and idx.indices(blocks.shape[0])[2] != 1
    if stepped or not (rows_contiguous(blocks) and rows_contiguous(scales)):  # gathered first
        return dequant_mxfp4_triton(blocks[idx], scales[idx], dtype, groups_per_program)
    n, slot0, index = slot_span(idx, blocks.shape[0], blocks.device, "mxfp4")
    out = torch.empty((n, *scales.shape[1:], 2 * BLOCK_BYTES), dtype=dtype, device=blocks.device)  # [n, ..., G, 32]
    per_row = scales[0].numel() if scales.shape[0] else 0
    if n and per_row:
        grid = (triton.cdiv(per_row, groups_per_program), n)
        _dequant_kernel[grid](blocks, scales, index if index is not None else scales, out, slot0, per_row,
                              blocks.stride(0), scales.stride(0), GROUPS=groups_per_program,
                              HAS_IDX=index is not None)
    return out.flatten(-2)  # [n, ..., G*32]


def dequant_mxfp4_triton(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                         groups_per_program: int = GROUPS_PER_PROGRAM) -> torch.Tensor:
    """blocks [..., G, 16] uint8 + scales [..., G] uint8 -> [..., G*32] in `dtype` (one launch)."""
    _check(blocks, scales)
    shape = scales.shape
    b = blocks.contiguous().view(1, -1, BLOCK_BYTES)  # one row of all groups
    out = dequant_mxfp4_rows(b, scales.contiguous().view(1, -1), slice(0, 1), dtype, groups_per_program)
    return out.view(*shape[:-1], shape[-1] * 2 * BLOCK_BYTES) if len(shape) else out.view(-1)


@triton.jit
def _e2m1_fp32(code):
    # 4-bit e2m1 code [int32] -> fp32 by bit fields: exponent field e + 126, mantissa bit at the top,
    # gives 2^(e-1) (1 + m/2), the value for e > 0; for e == 0 it gives 0.5 + 0.25 m, where the
    # value is 0.5 m = 2 v - 1
    v = (((code & 7) << 22) + (126 << 23)).to(tl.float32, bitcast=True)
    v = tl.where((code & 6) == 0, 2.0 * v - 1.0, v)
    return tl.where(code >= 8, -v, v)


@triton.jit
def mxfp4_tile(w_base, s_base, rows, rmask, k0, KDIM: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    # the grouped GEMM's weight tile (layers/grouped_moe_triton.py): rows [R] of one MXFP4 expert
    # weight [OUT, KDIM] at columns [k0, k0 + BK) -> fp32 [R, BK] (0 outside). Byte j holds elements
    # 2j (low nibble) and 2j + 1; BK is a multiple of 32, so a tile holds whole scale groups and each
    # scale multiplies 32 values as an exponent.
    jj = k0 // 2 + tl.arange(0, BK // 2)  # [BK/2] byte columns
    m2 = rmask[:, None] & (jj < KDIM // 2)[None, :]
    byte = tl.load(w_base + rows[:, None] * (KDIM // 2) + jj[None, :], mask=m2, other=0).to(tl.int32)
    w = tl.reshape(tl.join(_e2m1_fp32(byte & 0xF), _e2m1_fp32(byte >> 4)), (R, BK))  # [R, BK]
    gg = k0 // 32 + tl.arange(0, BK // 32)  # [BK/32] scale groups
    sm = rmask[:, None] & (gg < KDIM // 32)[None, :]
    s = tl.load(s_base + rows[:, None] * (KDIM // 32) + gg[None, :], mask=sm, other=127).to(tl.int32)
    scale = (s << 23).to(tl.float32, bitcast=True)  # E8M0 2^(s - 127); s = 0 (2^-127) reads as 0
    return tl.reshape(tl.reshape(w, (R, BK // 32, 32)) * scale[:, :, None], (R, BK))
