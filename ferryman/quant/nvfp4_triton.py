"""Triton kernels of the NVFP4 formats: the dequantiser reading the slot banks in place, the decode
GEMV's tile loader (layers/fused_moe_triton.py) and the grouped prefill GEMM's weight tile
(`nvfp4_tile`, layers/grouped_moe_triton.py).

A group of 16 values is 8 bytes (element 2j in byte j's low nibble) and one e4m3 scale byte; the
group's factor is fp32(scale) * g (nvfp4) or fp32(scale) / g (nvfp4-ct, an IEEE division), g the
tensor's global scale: the dequantiser's values are exactly `dequant_nvfp4`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferryman.quant.bank_slots import program_slot, rows_contiguous, slot_span
from ferryman.quant.fp8_triton import e4m3_to_f32

GROUP = 16


@triton.jit
def e2m1_to_f32(code):
    # 4-bit code (int32) -> fp32: sign bit 3, exponent bits 2..1, mantissa bit 0; e = 0 is 0 or 0.5
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    pow2 = (1 << tl.maximum(e - 1, 0)).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)
    return tl.where((code >> 3) == 1, -mag, mag)


@triton.jit
def group_factor(s_byte, g, DIVIDE: tl.constexpr):
    # e4m3 group scale (int32 byte) and global scale -> the group's fp32 factor (DIVIDE 1: s / g)
    s = e4m3_to_f32(s_byte)
    if DIVIDE == 1:
        return tl.math.div_rn(s, g)
    return s * g


@triton.jit
def nvfp4_rows_dot(w_base, s_base, g_base, rows, rmask, x_row, KDIM: tl.constexpr, NROWS: tl.constexpr,
                   PART_ROWS: tl.constexpr, DIVIDE: tl.constexpr, G: tl.constexpr):
    # rows: [R] weight rows of one expert; w_base -> bytes [rows, KDIM/2]; s_base -> e4m3 bytes
    # [rows, KDIM/16]; g_base -> fp32 global scales, row r uses g[r // PART_ROWS]; x_row -> [KDIM].
    # G groups of 16 inputs per step. Returns [R] fp32 dot products.
    NG: tl.constexpr = KDIM // 16
    offs_g = tl.arange(0, G)
    offs_j = tl.arange(0, 8)
    g = tl.load(g_base + rows // PART_ROWS, mask=rmask, other=1.0)  # [R]
    acc = tl.zeros([NROWS, G], dtype=tl.float32)
    for g0 in range(0, NG, G):
        grp = g0 + offs_g  # [G]
        m2 = rmask[:, None] & (grp < NG)[None, :]  # [R, G]
        boff = rows[:, None, None] * (NG * 8) + grp[None, :, None] * 8 + offs_j[None, None, :]
        b = tl.load(w_base + boff, mask=m2[:, :, None], other=0).to(tl.int32)  # [R, G, 8]
        xoff = grp[:, None] * 16 + offs_j[None, :] * 2  # [G, 8] element 2j of each group
        xmask = (grp < NG)[:, None]
        x_lo = tl.load(x_row + xoff, mask=xmask, other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + xoff + 1, mask=xmask, other=0.0).to(tl.float32)
        part = tl.sum(e2m1_to_f32(b & 15) * x_lo[None, :, :] + e2m1_to_f32(b >> 4) * x_hi[None, :, :], axis=2)
        s = tl.load(s_base + rows[:, None] * NG + grp[None, :], mask=m2, other=0).to(tl.int32)  # [R, G]
        acc += part * group_factor(s, g[:, None], DIVIDE)
    return tl.sum(acc, axis=1)


@triton.jit
def nvfp4_tile(w_base, s_base, g_base, rows, rmask, k0, KDIM: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
               PART_ROWS: tl.constexpr, DIVIDE: tl.constexpr):
    # the grouped GEMM's weight tile (layers/grouped_moe_triton.py): rows [R] of one expert's weight
    # [OUT, KDIM] at inputs [k0, k0 + BK) -> fp32 code x group factor [R, BK] (0 outside), exactly
    # `dequant_nvfp4`'s values before its rounding. Banks as nvfp4_rows_dot's; BK a multiple of 16.
    jj = k0 // 2 + tl.arange(0, BK // 2)  # [BK/2] byte columns: element 2j low nibble, 2j + 1 high
    m2 = rmask[:, None] & (jj < KDIM // 2)[None, :]
    b = tl.load(w_base + rows[:, None] * (KDIM // 2) + jj[None, :], mask=m2, other=0).to(tl.int32)
    w = tl.reshape(tl.join(e2m1_to_f32(b & 15), e2m1_to_f32(b >> 4)), [R, BK])  # [R, BK]
    NG: tl.constexpr = KDIM // 16
    grp = k0 // 16 + tl.arange(0, BK // 16)  # [BK/16] groups
    sm = rmask[:, None] & (grp < NG)[None, :]
    s = tl.load(s_base + rows[:, None] * NG + grp[None, :], mask=sm, other=0).to(tl.int32)  # [R, BK/16]
    g = tl.load(g_base + rows // PART_ROWS, mask=rmask, other=1.0)  # [R]
    f = group_factor(s, g[:, None], DIVIDE)
    return tl.reshape(tl.reshape(w, [R, BK // 16, 16]) * f[:, :, None], [R, BK])


@triton.jit
def _dequant_kernel(p_ptr, s_ptr, g_ptr, idx_ptr, out_ptr, slot0, p_stride, s_stride, g_stride, n_groups,
                    GROUPS_PER_ROW: tl.constexpr, PART_ROWS: tl.constexpr, DIVIDE: tl.constexpr,
                    HAS_IDX: tl.constexpr, GROUPS: tl.constexpr):
    # program (p, r): groups p*GROUPS .. +GROUPS of expert slot idx[r] (or slot0 + r) -> output row r
    r, slot = program_slot(idx_ptr, slot0, HAS_IDX)
    gi = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS] group ids
    gmask = gi < n_groups
    j = tl.arange(0, 8)
    b = tl.load(p_ptr + slot * p_stride + gi[:, None] * 8 + j[None, :], mask=gmask[:, None], other=0).to(tl.int32)
    s = tl.load(s_ptr + slot * s_stride + gi, mask=gmask, other=0).to(tl.int32)
    g = tl.load(g_ptr + slot * g_stride + (gi // GROUPS_PER_ROW) // PART_ROWS, mask=gmask, other=1.0)
    f = group_factor(s, g, DIVIDE)[:, None]  # [GROUPS, 1]
    lo = e2m1_to_f32(b & 15) * f
    hi = e2m1_to_f32(b >> 4) * f
    vals = tl.reshape(tl.join(lo, hi), (GROUPS, 16))  # lo0 hi0 lo1 hi1 ...
    dst = out_ptr + (r.to(tl.int64) * n_groups + gi[:, None]) * 16 + tl.arange(0, 16)[None, :]
    tl.store(dst, vals.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


GROUPS_PER_PROGRAM = 128


def dequant_nvfp4_rows(packed: torch.Tensor, scale: torch.Tensor, gscale: torch.Tensor, idx: torch.Tensor | slice,
                       divide: bool, dtype: torch.dtype) -> torch.Tensor:
    """Experts `idx` of banks packed [E, out, k/2] + scale [E, out, k/16] e4m3 + gscale [E, parts]
    -> [n, out, k] in `dtype`, read in place (one launch)."""
    e, out, half = packed.shape
    k, parts = 2 * half, gscale.shape[-1]
    if tuple(scale.shape) != (e, out, k // GROUP) or tuple(gscale.shape[:1]) != (e,) or out % parts:
        raise ValueError(f"nvfp4 banks do not match: packed {tuple(packed.shape)}, scale {tuple(scale.shape)}, "
                         f"global {tuple(gscale.shape)}")
    if not (rows_contiguous(packed) and rows_contiguous(scale)):
        packed, scale = packed.contiguous(), scale.contiguous()
    n, slot0, index = slot_span(idx, e, packed.device, "nvfp4")
    result = torch.empty((n, out, k), dtype=dtype, device=packed.device)
    n_groups = out * k // GROUP
    if n and n_groups:
        grid = (triton.cdiv(n_groups, GROUPS_PER_PROGRAM), n)
        _dequant_kernel[grid](packed, scale.view(torch.uint8), gscale, index if index is not None else gscale, result,
                              slot0, packed.stride(0), scale.stride(0), gscale.stride(0), n_groups,
                              GROUPS_PER_ROW=k // GROUP, PART_ROWS=out // parts, DIVIDE=divide,
                              HAS_IDX=index is not None, GROUPS=GROUPS_PER_PROGRAM)
    return result
