"""Triton reading of GGUF blocks: `gguf_values` decodes any element of a row of ggml blocks where
it lies (the decode GEMV's tiles and the dequantiser below share it), `dequant_gguf_rows` dequantises
expert slots in place (the batched prefill path). Values equal quant/gguf_blocks.py's bit for bit: each
is a fp16 scale times small integers (exact in fp32) plus at most one other exact product, so a fused
multiply-add the compiler may form rounds the same once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferryman.quant.bank_slots import program_slot, rows_contiguous, slot_span
from ferryman.quant.gguf_blocks import BLOCK_SIZES, check_type
from ferryman.quant.gguf_triton_gemv import kquant_rows_dot, q6k_rows_dot, q8_0_rows_dot

# type name -> the constexpr code the kernels branch on (0: not a GGUF bank)
TYPE_CODES = {name: i + 1 for i, name in enumerate(BLOCK_SIZES)}
F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4 = (
    tl.constexpr(TYPE_CODES[n]) for n in BLOCK_SIZES)
# by type code: values and bytes of one block (quant/gguf_blocks.py), as kernels read them
_BLOCK_VALUES = tl.constexpr((0, *(bs for bs, _ in BLOCK_SIZES.values())))
_BLOCK_BYTES = tl.constexpr((0, *(ts for _, ts in BLOCK_SIZES.values())))


def type_code(gtype: str) -> int:
    return TYPE_CODES[check_type(gtype)]


@triton.jit
def _u8(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(p, mask):
    # fp16 field at uint8 pointer p (2-byte aligned: every block and field offset is even)
    return tl.load(p.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _iq4(q):
    # IQ4_NL / IQ4_XS code 0..15 -> its value (ggml's kvalues_iq4nl)
    lo = tl.where(q < 4, tl.where(q < 2, tl.where(q == 0, -127, -104), tl.where(q == 2, -83, -65)),
                  tl.where(q < 6, tl.where(q == 4, -49, -35), tl.where(q == 6, -22, -10)))
    hi = tl.where(q < 12, tl.where(q < 10, tl.where(q == 8, 1, 13), tl.where(q == 10, 25, 38)),
                  tl.where(q < 14, tl.where(q == 12, 53, 69), tl.where(q == 14, 89, 113)))
    return tl.where(q < 8, lo, hi).to(tl.float32)


@triton.jit
def _k_scale_min(sp, sub, mask):
    # Q4_K / Q5_K: 6-bit scale and min of sub-block `sub` (0..7) from the 12 bytes at sp
    lo = sub < 4
    s4 = tl.where(lo, sub, sub - 4)
    a = _u8(sp + s4, mask)  # scales 0..3, their bits 6..7: high bits of scales 4..7
    b = _u8(sp + 4 + s4, mask)  # mins 0..3, likewise
    c = _u8(sp + 8 + s4, mask)  # low bits of scale and min 4..7
    sc = tl.where(lo, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(lo, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc, mn


@triton.jit
def _k4_nibble(qp, j, mask):
    # Q4_K / Q5_K 4-bit part of element j (0..255): 32-byte chunks, low nibbles then high ones
    return (_u8(qp + (j // 64) * 32 + j % 32, mask) >> (4 * ((j // 32) % 2))) & 15


@triton.jit
def _crumb(qp, j, mask):
    # 2-bit field of element j in 32-byte chunks of 4 shifts (Q2_K, Q3_K low bits, Q6_K high bits)
    return (_u8(qp + (j // 128) * 32 + j % 32, mask) >> (2 * ((j % 128) // 32))) & 3


@triton.jit
def _small_block(row, k, mask, T: tl.constexpr):
    # 32-value blocks: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4 (nibble j%16, high half j >= 16)
    j = k % 32
    b = row + (k // 32) * _BLOCK_BYTES[T]
    if T == Q8_0:
        q = tl.load((b + 2 + j).to(tl.pointer_type(tl.int8)), mask=mask, other=0).to(tl.float32)
        v = _f16(b, mask) * q
    elif T == MXFP4:
        c = (_u8(b + 1 + j % 16, mask) >> (4 * (j // 16))) & 15
        e = (c >> 1) & 3
        mag = tl.where(e == 0, c & 1, (2 + (c & 1)) << tl.maximum(e - 1, 0))  # e2m1 x 2
        q = tl.where(c >= 8, -mag, mag).to(tl.float32)
        s = _u8(b, mask)
        bits = tl.where(s < 2, 0x00200000 << s, (s - 1) << 23)  # 2^(s-128), ggml_e8m0_to_fp32_half
        v = bits.to(tl.float32, bitcast=True) * q
    else:
        QS: tl.constexpr = _BLOCK_BYTES[T] - 16  # nibbles at the block's tail
        q = (_u8(b + QS + j % 16, mask) >> (4 * (j // 16))) & 15
        if T == Q5_0 or T == Q5_1:
            q = q | (((_u8(b + QS - 4 + j // 8, mask) >> (j % 8)) & 1) << 4)
        d = _f16(b, mask)
        if T == Q4_0:
            v = d * (q - 8).to(tl.float32)
        elif T == IQ4_NL:
            v = d * _iq4(q)
        elif T == Q5_0:
            v = d * (q - 16).to(tl.float32)
        else:  # Q4_1, Q5_1: d x q + m
            v = d * q.to(tl.float32) + _f16(b + 2, mask)
    return v


@triton.jit
def _super_block(row, k, mask, T: tl.constexpr):
    # 256-value super-blocks: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS
    j = k % 256
    b = row + (k // 256) * _BLOCK_BYTES[T]
    if T == Q4_K or T == Q5_K:
        sc, mn = _k_scale_min(b + 4, j // 32, mask)
        if T == Q4_K:
            q = _k4_nibble(b + 16, j, mask)
        else:
            q = _k4_nibble(b + 48, j, mask) | (((_u8(b + 16 + j % 32, mask) >> (j // 32)) & 1) << 4)
        v = (_f16(b, mask) * sc.to(tl.float32)) * q.to(tl.float32) - _f16(b + 2, mask) * mn.to(tl.float32)
    elif T == Q6_K:
        jj = j % 128
        ql = (_u8(b + (j // 128) * 64 + jj % 64, mask) >> (4 * (jj // 64))) & 15
        q = (ql | (_crumb(b + 128, j, mask) << 4)) - 32
        sc = tl.load((b + 192 + j // 16).to(tl.pointer_type(tl.int8)), mask=mask, other=0).to(tl.float32)
        v = (_f16(b + 208, mask) * sc) * q.to(tl.float32)
    elif T == Q2_K:
        s = _u8(b + j // 16, mask)
        dl = _f16(b + 80, mask) * (s & 15).to(tl.float32)
        v = dl * _crumb(b + 16, j, mask).to(tl.float32) - _f16(b + 82, mask) * (s >> 4).to(tl.float32)
    elif T == Q3_K:
        sub = j // 16
        low = (_u8(b + 96 + sub % 8, mask) >> (4 * (sub // 8))) & 15
        high = (_u8(b + 104 + sub % 4, mask) >> (2 * (sub // 4))) & 3
        dl = _f16(b + 108, mask) * ((low | (high << 4)) - 32).to(tl.float32)
        hbit = (_u8(b + j % 32, mask) >> (j // 32)) & 1
        v = dl * (_crumb(b + 32, j, mask) - 4 * (1 - hbit)).to(tl.float32)
    else:  # IQ4_XS
        ib = j // 32
        hs = _u8(b + 2 + ib // 4, mask) >> (2 * (ib % 4))
        ls = ((_u8(b + 4 + ib // 2, mask) >> (4 * (ib % 2))) & 15) | ((hs & 3) << 4)
        q = (_u8(b + 8 + ib * 16 + j % 16, mask) >> (4 * ((j % 32) // 16))) & 15
        v = (_f16(b, mask) * (ls - 32).to(tl.float32)) * _iq4(q)
    return v


@triton.jit
def gguf_values(row, k, mask, T: tl.constexpr):
    """fp32 values at element indices k of the rows of `T` blocks starting at uint8 pointers `row`
    (k and row broadcast together); masked elements read as 0."""
    if T == F32:
        v = tl.load(row.to(tl.pointer_type(tl.float32)) + k, mask=mask, other=0.0)
    elif T == F16:
        v = tl.load(row.to(tl.pointer_type(tl.float16)) + k, mask=mask, other=0.0).to(tl.float32)
    elif T == BF16:
        h = tl.load(row.to(tl.pointer_type(tl.int16)) + k, mask=mask, other=0).to(tl.int32)
        v = ((h & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    elif T == Q2_K or T == Q3_K or T == Q4_K or T == Q5_K or T == Q6_K or T == IQ4_XS:
        v = _super_block(row, k, mask, T)
    else:
        v = _small_block(row, k, mask, T)
    return v


@triton.jit
def _dequant_kernel(q_ptr, idx_ptr, out_ptr, slot0, slot_stride, out_rows, K: tl.constexpr, ROWS: tl.constexpr,
                    T: tl.constexpr, HAS_IDX: tl.constexpr):
    # program (p, r): rows p*ROWS .. +ROWS of bank slot idx[r] (HAS_IDX) or slot0 + r, each K values
    # of T blocks, its slot's rows contiguous -> out[r, rows]. Steps of 256 values read every row
    # from its chunk's base pointer with constant offsets (vector loads, 256-value stores).
    r, slot = program_slot(idx_ptr, slot0, HAS_IDX)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < out_rows
    row = q_ptr + slot * slot_stride + rows.to(tl.int64)[:, None] * _row_bytes(K, T)  # [ROWS, 1]
    dst = out_ptr + (r.to(tl.int64) * out_rows + rows.to(tl.int64))[:, None] * K
    step = _row_bytes(_CH, T)
    j = tl.arange(0, _CH)
    for c in range(0, tl.cdiv(K, _CH)):
        k = c * _CH + j
        mask = rmask[:, None] & (k < K)[None, :]
        v = gguf_values(row + c * step, j[None, :], mask, T)  # [ROWS, 256]
        tl.store(dst + k[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)


ROWS_PER_PROGRAM = 16


def dequant_gguf_rows(q: torch.Tensor, gtype: str, idx: torch.Tensor | slice, dtype: torch.dtype,
                      rows_per_program: int = ROWS_PER_PROGRAM) -> torch.Tensor:
    """Slots `idx` of a bank q uint8 [E, out, row_bytes] of `gtype` rows -> [n, out, K] in `dtype`,
    read in place (one launch, no host sync). idx: a step-1 slice or a 1-D int tensor on q's
    device. Each slot's [out, row_bytes] must be contiguous; slots may be any stride apart."""
    bs, ts = BLOCK_SIZES[check_type(gtype)]
    if q.dtype != torch.uint8 or q.dim() != 3 or q.shape[-1] % ts or not rows_contiguous(q):
        raise ValueError(f"GGUF {gtype} bank: expected uint8 [E, out, k x {ts}] with contiguous slots, got "
                         f"{tuple(q.shape)} {q.dtype} strides {tuple(q.stride())}")
    _, out_rows, rb = q.shape
    k = rb // ts * bs
    n, slot0, index = slot_span(idx, q.shape[0], q.device, "GGUF")
    out = torch.empty((n, out_rows, k), dtype=dtype, device=q.device)
    if n and out_rows:
        grid = (triton.cdiv(out_rows, rows_per_program), n)
        _dequant_kernel[grid](q, index if index is not None else q, out, slot0, q.stride(0), out_rows,
                              K=k, ROWS=rows_per_program, T=type_code(gtype), HAS_IDX=index is not None)
    return out


@triton.jit
def _row_bytes(K: tl.constexpr, T: tl.constexpr):
    # bytes of a row of K values of type T
    return K // _BLOCK_VALUES[T] * _BLOCK_BYTES[T]


CHUNK = 256  # values per decode step: one super-block, or 8 blocks of 32 (a whole number of any type's blocks)
_CH = tl.constexpr(CHUNK)


@triton.jit
def gguf_rows_dot(w_base, rows, rmask, x_row, KDIM: tl.constexpr, NROWS: tl.constexpr, T: tl.constexpr):
    """Decode GEMV tile loop: rows [R] of one expert's GGUF bank slice at uint8 pointer w_base
    ([OUT, row_bytes], contiguous) dotted with x_row -> [KDIM] -> [R] fp32, the weights decoded
    from their blocks in registers (fp32, exact). Each step reads one 256-value chunk of every row
    from its own base pointer with constant in-chunk offsets, so the compiler sees the runs of
    contiguous bytes (vector loads) and the per-block constants."""
    if T == Q4_K or T == Q5_K:  # whole-word reads (quant/gguf_triton_gemv.py)
        out = kquant_rows_dot(w_base, rows, rmask, x_row, KDIM, NROWS, T == Q5_K)
    elif T == Q6_K:
        out = q6k_rows_dot(w_base, rows, rmask, x_row, KDIM, NROWS)
    elif T == Q8_0:
        out = q8_0_rows_dot(w_base, rows, rmask, x_row, KDIM, NROWS)
    else:
        row = w_base + rows.to(tl.int64)[:, None] * _row_bytes(KDIM, T)  # [R, 1]
        step = _row_bytes(_CH, T)  # bytes of one chunk
        j = tl.arange(0, _CH)
        acc = tl.zeros([NROWS, _CH], dtype=tl.float32)
        for c in range(0, tl.cdiv(KDIM, _CH)):
            k = c * _CH + j
            kmask = k < KDIM
            w = gguf_values(row + c * step, j[None, :], rmask[:, None] & kmask[None, :], T)  # [R, 256]
            xv = tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32)
            acc += w * xv[None, :]
        out = tl.sum(acc, axis=1)
    return out
