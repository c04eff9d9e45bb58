"""Triton kernels of the `fp8:*` formats: the dequantiser (prefill's batched path) reading the slot
banks in place, the decode GEMV's tile loader (layers/fused_moe_triton.py) and the grouped prefill
GEMM's weight tile (`fp8_tile`, layers/grouped_moe_triton.py).

e4m3 bytes are decoded from their bits (no fp8 pointer types, so the interpreter runs them too):
exponent field e, mantissa m: e = 0 is m x 2^-9, else (8 + m) x 2^(e - 10), which is the fp32 with
exponent field e + 120 and mantissa m << 20. The decoded value and the fp32 product are exactly
what `dequant_fp8` computes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferryman.quant.bank_slots import program_slot, rows_contiguous, slot_span

Block = tuple[int, int] | None  # as quant/fp8.py: (bn, bk), None a scale per row


@triton.jit
def e4m3_to_f32(b):
    # b: int32 holding one e4m3 byte -> its fp32 value (exact; 0x7f / 0xff, e4m3's NaN, read as 480)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # 2^-9
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def fp8_rows_dot(w_base, s_base, rows, rmask, x_row, KDIM: tl.constexpr, NROWS: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, BLOCK_K: tl.constexpr):
    # rows: [R] weight rows of one expert; w_base -> e4m3 bytes [rows, KDIM]; s_base -> fp32 scales
    # [ceil(rows/BN), ceil(KDIM/BK)], or with BK = 0 one per row [rows]; x_row -> [KDIM]. Blocks:
    # tiles of BK inputs (a power of two) share one scale per row; per row: tiles of BLOCK_K.
    # Returns [R] fp32 dot products.
    TILE: tl.constexpr = BLOCK_K if BK == 0 else BK
    SK: tl.constexpr = (KDIM + TILE - 1) // TILE
    offs_k = tl.arange(0, TILE)
    acc = tl.zeros([NROWS], dtype=tl.float32)
    for k0 in range(0, KDIM, TILE):
        k = k0 + offs_k
        kmask = k < KDIM
        w = tl.load(w_base + rows[:, None] * KDIM + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0)
        xv = tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32)
        part = tl.sum(e4m3_to_f32(w.to(tl.int32)) * xv[None, :], axis=1)  # [R]
        if BK == 0:
            acc += part
        else:
            s = tl.load(s_base + (rows // BN) * SK + k0 // TILE, mask=rmask, other=0.0)
            acc += part * s
    if BK == 0:
        acc *= tl.load(s_base + rows, mask=rmask, other=0.0)
    return acc


@triton.jit
def fp8_tile(w_base, s_base, rows, rmask, k0, KDIM: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
             SBN: tl.constexpr, SBK: tl.constexpr):
    # the grouped GEMM's weight tile (layers/grouped_moe_triton.py): rows [R] of one expert's e4m3
    # weight [OUT, KDIM] at inputs [k0, k0 + BK) -> fp32 e4m3 x scale [R, BK] (0 outside), exactly
    # `dequant_fp8`'s values before its rounding. Scales: SBN x SBK blocks [ceil(OUT/SBN), ceil(KDIM/SBK)],
    # SBK 0 one per row [OUT]. One scale per row when the tile lies in one block (SBK 0, or SBK a
    # multiple of BK; k0 is a multiple of BK), one per SBK inputs when BK is a multiple of SBK, else
    # gathered per input.
    k = k0 + tl.arange(0, BK)
    kmask = k < KDIM
    m2 = rmask[:, None] & kmask[None, :]
    w = e4m3_to_f32(tl.load(w_base + rows[:, None] * KDIM + k[None, :], mask=m2, other=0).to(tl.int32))
    SDIV: tl.constexpr = SBK if SBK > 0 else 1  # constexprs are built for every branch
    SK: tl.constexpr = (KDIM + SDIV - 1) // SDIV
    if SBK == 0:
        return w * tl.load(s_base + rows, mask=rmask, other=0.0)[:, None]
    elif SBK % BK == 0:
        return w * tl.load(s_base + (rows // SBN) * SK + k0 // SBK, mask=rmask, other=0.0)[:, None]
    elif BK % SBK == 0:
        NS: tl.constexpr = BK // SBK
        sc = k0 // SBK + tl.arange(0, NS)  # [NS] scale columns
        s = tl.load(s_base + (rows // SBN)[:, None] * SK + sc[None, :], mask=rmask[:, None] & (sc < SK)[None, :],
                    other=0.0)
        return tl.reshape(tl.reshape(w, [R, NS, SBK]) * s[:, :, None], [R, BK])
    else:
        return w * tl.load(s_base + (rows // SBN)[:, None] * SK + (k // SBK)[None, :], mask=m2, other=0.0)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, idx_ptr, out_ptr, slot0, q_stride, s_stride, n_elem,
                    OUT: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    CHANNEL: tl.constexpr, HAS_IDX: tl.constexpr, CHUNK: tl.constexpr):
    # program (p, r): elements p*CHUNK .. +CHUNK of expert slot idx[r] (or slot0 + r) -> output row r
    r, slot = program_slot(idx_ptr, slot0, HAS_IDX)
    i = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = i < n_elem
    row, col = i // K, i % K
    q = tl.load(q_ptr + slot * q_stride + i, mask=mask, other=0).to(tl.int32)
    if CHANNEL:
        s = tl.load(s_ptr + slot * s_stride + row, mask=mask, other=0.0)
    else:
        SK: tl.constexpr = (K + BK - 1) // BK
        s = tl.load(s_ptr + slot * s_stride + (row // BN) * SK + col // BK, mask=mask, other=0.0)
    tl.store(out_ptr + r.to(tl.int64) * n_elem + i, (e4m3_to_f32(q) * s).to(out_ptr.dtype.element_ty), mask=mask)


CHUNK = 1024


def dequant_fp8_rows(q: torch.Tensor, s: torch.Tensor, idx: torch.Tensor | slice, block: Block,
                     dtype: torch.dtype) -> torch.Tensor:
    """Experts `idx` of banks q [E, out, k] e4m3 + s [E, *scale_grid] fp32 -> [n, out, k] in `dtype`,
    read in place (one launch). idx: a step-1 slice or a 1-D int tensor on the banks' device."""
    e, out, k = q.shape
    grid = (out,) if block is None else (-(-out // block[0]), -(-k // block[1]))
    if tuple(s.shape[1:]) != grid or s.dtype != torch.float32:
        raise ValueError(f"fp8 scales {tuple(s.shape)} {s.dtype} do not match weights {tuple(q.shape)} (block {block})")
    if not (rows_contiguous(q) and rows_contiguous(s)):
        q, s = q.contiguous(), s.contiguous()
    n, slot0, index = slot_span(idx, e, q.device, "fp8")
    result = torch.empty((n, out, k), dtype=dtype, device=q.device)
    if n and out * k:
        bn, bk = block if block is not None else (1, 1)
        grid = (triton.cdiv(out * k, CHUNK), n)
        _dequant_kernel[grid](q.view(torch.uint8), s, index if index is not None else s, result, slot0,
                              q.stride(0), s.stride(0), out * k, OUT=out, K=k, BN=bn, BK=bk,
                              CHANNEL=block is None, HAS_IDX=index is not None, CHUNK=CHUNK)
    return result
