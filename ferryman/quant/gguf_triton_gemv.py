"""Decode GEMV of Q4_K / Q5_K rows (the bulk of the Q4_K_M and Q5_K_M mixes) on whole words.

A 256-value super-block is d, dmin (fp16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of
32, [Q5_K: 32 bytes of 5th bits,] then 128 bytes of nibbles: byte p of 32-byte chunk c holds
element 64c + p in its low nibble and 64c + 32 + p in its high one. So
    dot(row, x) = sum over super-blocks of  d * sum_s sc[s] * (q_s . x_s)  -  dmin * sum_s m[s] * sum(x_s)
The nibbles are read as 32 int32 words per super-block (16-byte vector loads: every super-block and
its fields start 16-byte aligned), sub-block sums come from those words, the scales from 24 bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scale_min(sp, sub, mask):
    # 6-bit scale and min of sub-blocks `sub` from the 12 bytes at sp (as quant/gguf_triton.py)
    lo = sub < 4
    s4 = tl.where(lo, sub, sub - 4)
    a = tl.load(sp + s4, mask=mask, other=0).to(tl.int32)
    b = tl.load(sp + 4 + s4, mask=mask, other=0).to(tl.int32)
    c = tl.load(sp + 8 + s4, mask=mask, other=0).to(tl.int32)
    sc = tl.where(lo, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(lo, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _superblock_dot(blk, rmask, x_sb, FIVE: tl.constexpr, NROWS: tl.constexpr):
    # blk: [R, 1] uint8 pointers to one super-block of each row; x_sb -> its 256 inputs. -> [R]
    QS: tl.constexpr = 48 if FIVE else 16  # byte offset of the nibbles
    w = tl.arange(0, 32)  # word: chunk w // 8, bytes p = 4 (w % 8) .. +3
    m2 = rmask[:, None]
    words = tl.load((blk + QS).to(tl.pointer_type(tl.int32)) + w[None, :], mask=m2, other=0)  # [R, 32]
    if FIVE:  # the 5th bits: bit 2c + h of qh byte p
        qh = tl.load((blk + 16).to(tl.pointer_type(tl.int32)) + (w % 8)[None, :], mask=m2, other=0)  # [R, 32]
    chunk = w // 8
    x_lo_base = x_sb + chunk * 64 + (w % 8) * 4  # [32] element of byte 0's low nibble
    lo = tl.zeros([NROWS, 32], dtype=tl.float32)
    hi = tl.zeros([NROWS, 32], dtype=tl.float32)
    for b in tl.static_range(4):
        q_lo = (words >> (8 * b)) & 15
        q_hi = (words >> (8 * b + 4)) & 15
        if FIVE:
            q_lo = q_lo | (((qh >> (8 * b + 2 * chunk[None, :])) & 1) << 4)
            q_hi = q_hi | (((qh >> (8 * b + 2 * chunk[None, :] + 1)) & 1) << 4)
        x_lo = tl.load(x_lo_base + b).to(tl.float32)
        x_hi = tl.load(x_lo_base + 32 + b).to(tl.float32)
        lo += q_lo.to(tl.float32) * x_lo[None, :]
        hi += q_hi.to(tl.float32) * x_hi[None, :]
    qx_lo = tl.sum(tl.reshape(lo, [NROWS, 4, 8]), axis=2)  # [R, 4]: q . x of sub-block 2c
    qx_hi = tl.sum(tl.reshape(hi, [NROWS, 4, 8]), axis=2)  # sub-block 2c + 1
    xs = tl.sum(tl.reshape(tl.load(x_sb + tl.arange(0, 256)).to(tl.float32), [4, 2, 32]), axis=2)  # [4, 2]
    xs_lo, xs_hi = tl.split(xs)  # [4] sums of x over sub-blocks 2c, 2c + 1
    c4 = tl.arange(0, 4)[None, :]
    sc_lo, mn_lo = _scale_min(blk + 4, 2 * c4, m2)  # [R, 4]
    sc_hi, mn_hi = _scale_min(blk + 4, 2 * c4 + 1, m2)
    d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)  # [R, 1]
    dmin = tl.load((blk + 2).to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)
    scaled = tl.sum(sc_lo * qx_lo + sc_hi * qx_hi, axis=1)  # [R]
    mins = tl.sum(mn_lo * xs_lo[None, :] + mn_hi * xs_hi[None, :], axis=1)
    return tl.reshape(d, [NROWS]) * scaled - tl.reshape(dmin, [NROWS]) * mins


@triton.jit
def kquant_rows_dot(w_base, rows, rmask, x_row, KDIM: tl.constexpr, NROWS: tl.constexpr, FIVE: tl.constexpr):
    """rows [R] of one expert's Q4_K (FIVE: Q5_K) bank slice at uint8 w_base, dotted with
    x_row -> [KDIM] (KDIM % 256 == 0) -> [R] fp32."""
    TS: tl.constexpr = 176 if FIVE else 144
    NSB: tl.constexpr = KDIM // 256
    row = w_base + rows.to(tl.int64)[:, None] * (NSB * TS)  # [R, 1]
    acc = tl.zeros([NROWS], dtype=tl.float32)
    for sb in range(0, NSB):
        acc += _superblock_dot(row + sb * TS, rmask, x_row + sb * 256, FIVE, NROWS)
    return acc
