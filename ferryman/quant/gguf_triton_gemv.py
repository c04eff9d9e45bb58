"""Decode GEMV of Q4_K / Q5_K / Q6_K / Q8_0 rows (the Q4_K_M, Q5_K_M and Q8_0 mixes) on whole words;
the other types go through quant/gguf_triton.py's per-value decoder.

Q4_K / Q5_K: a 256-value super-block is d, dmin (fp16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of
32, [Q5_K: 32 bytes of 5th bits,] then 128 bytes of nibbles: byte p of 32-byte chunk c holds
element 64c + p in its low nibble and 64c + 32 + p in its high one. So
    dot(row, x) = sum over super-blocks of  d * sum_s sc[s] * (q_s . x_s)  -  dmin * sum_s m[s] * sum(x_s)
The nibbles are read as 32 int32 words per super-block (16-byte vector loads: every super-block and
its fields start 16-byte aligned), sub-block sums come from those words, the scales from 24 bytes.
Q6_K (210-byte blocks) and Q8_0 (34) are only 2-byte aligned: their codes are read as halfwords.
Every loop loads the next super-block's codes before multiplying the current one's.
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
def _kq_load(blk, rmask, FIVE: tl.constexpr):
    # the nibbles of one super-block of each row as words [R, 32] (word w: chunk w // 8, bytes
    # p = 4 (w % 8) .. +3) and, Q5_K, the 5th-bit word holding bytes p (else the nibbles again)
    QS: tl.constexpr = 48 if FIVE else 16  # byte offset of the nibbles
    w = tl.arange(0, 32)
    m2 = rmask[:, None]
    words = tl.load((blk + QS).to(tl.pointer_type(tl.int32)) + w[None, :], mask=m2, other=0)  # [R, 32]
    if FIVE:  # the 5th bits: bit 2c + h of qh byte p
        qh = tl.load((blk + 16).to(tl.pointer_type(tl.int32)) + (w % 8)[None, :], mask=m2, other=0)
    else:
        qh = words
    return words, qh


@triton.jit
def _superblock_dot(blk, words, qh, rmask, x_sb, FIVE: tl.constexpr, NROWS: tl.constexpr):
    # blk: [R, 1] uint8 pointers to one super-block of each row, words/qh: its _kq_load; x_sb -> its
    # 256 inputs. -> [R]
    w = tl.arange(0, 32)
    m2 = rmask[:, None]
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
    words, qh = _kq_load(row, rmask, FIVE)
    for sb in range(0, NSB):
        # the next super-block's words in flight while this one is multiplied
        next_words, next_qh = _kq_load(row + (sb + 1) * TS, rmask & (sb + 1 < NSB), FIVE)
        acc += _superblock_dot(row + sb * TS, words, qh, rmask, x_row + sb * 256, FIVE, NROWS)
        words, qh = next_words, next_qh
    return acc


@triton.jit
def _q6k_load(blk, rmask):
    # Q6_K (210 bytes: ql[128], qh[64], int8 scales[16], fp16 d; 2-byte aligned) as halfwords.
    # Element j = 128c + 32s + 2p + e (c < 2, s < 4, p < 16, e < 2) is, with v = 16c + p: ql
    # halfword 32c + 16(s%2) + p, byte e, nibble s//2; qh halfword v, byte e, bits 2s; scale j // 16.
    v = tl.arange(0, 32)
    m2 = rmask[:, None]
    hp = blk.to(tl.pointer_type(tl.int16))
    u0 = v + (v // 16) * 16
    ql0 = tl.load(hp + u0[None, :], mask=m2, other=0).to(tl.int32)  # [R, 32] s = 0, 2
    ql1 = tl.load(hp + 16 + u0[None, :], mask=m2, other=0).to(tl.int32)  # s = 1, 3
    qh = tl.load(hp + 64 + v[None, :], mask=m2, other=0).to(tl.int32)
    return ql0, ql1, qh


@triton.jit
def _q6k_superblock_dot(blk, ql0, ql1, qh, rmask, x_sb, NROWS: tl.constexpr):
    # one super-block of each row ([R, 1] pointers, its _q6k_load) dotted with x_sb -> 256 inputs -> [R]
    v = tl.arange(0, 32)
    m2 = rmask[:, None]
    x_base = x_sb + (v // 16) * 128 + (v % 16) * 2  # [32]
    g4 = tl.arange(0, 4)[None, :]
    acc = tl.zeros([NROWS], dtype=tl.float32)
    for s in tl.static_range(4):
        ql = ql1 if s % 2 else ql0
        part = tl.zeros([NROWS, 32], dtype=tl.float32)
        for e in tl.static_range(2):
            q = (((ql >> (8 * e + 4 * (s // 2))) & 15) | (((qh >> (8 * e + 2 * s)) & 3) << 4)) - 32
            part += q.to(tl.float32) * tl.load(x_base + 32 * s + e).to(tl.float32)[None, :]
        sums = tl.sum(tl.reshape(part, [NROWS, 4, 8]), axis=2)  # [R, 4]: groups g of 8 v, one scale each
        sc = tl.load((blk + 192 + (g4 // 2) * 8 + 2 * s + g4 % 2).to(tl.pointer_type(tl.int8)), mask=m2, other=0)
        acc += tl.sum(sc.to(tl.float32) * sums, axis=1)
    d = tl.load((blk + 208).to(tl.pointer_type(tl.float16)), mask=m2, other=0.0).to(tl.float32)  # [R, 1]
    return tl.reshape(d, [NROWS]) * acc


@triton.jit
def q6k_rows_dot(w_base, rows, rmask, x_row, KDIM: tl.constexpr, NROWS: tl.constexpr):
    """rows [R] of one expert's Q6_K bank slice at uint8 w_base, dotted with x_row -> [KDIM] -> [R] fp32."""
    NSB: tl.constexpr = KDIM // 256
    row = w_base + rows.to(tl.int64)[:, None] * (NSB * 210)  # [R, 1]
    acc = tl.zeros([NROWS], dtype=tl.float32)
    ql0, ql1, qh = _q6k_load(row, rmask)
    for sb in range(0, NSB):
        # the next super-block's codes in flight while this one is multiplied
        n0, n1, nh = _q6k_load(row + (sb + 1) * 210, rmask & (sb + 1 < NSB))
        acc += _q6k_superblock_dot(row + sb * 210, ql0, ql1, qh, rmask, x_row + sb * 256, NROWS)
        ql0, ql1, qh = n0, n1, nh
    return acc


@triton.jit
def q8_0_rows_dot(w_base, rows, rmask, x_row, KDIM: tl.constexpr, NROWS: tl.constexpr):
    """rows [R] of one expert's Q8_0 bank slice (34-byte blocks: fp16 d, 32 int8) at uint8 w_base,
    dotted with x_row -> [KDIM] (KDIM % 32 == 0) -> [R] fp32; 8 blocks a step, codes as halfwords."""
    NB: tl.constexpr = KDIM // 32
    row = w_base + rows.to(tl.int64)[:, None, None] * (NB * 34)  # [R, 1, 1]
    b8 = tl.arange(0, 8)[None, :, None]
    i16 = tl.arange(0, 16)[None, None, :]
    acc = tl.zeros([NROWS, 8], dtype=tl.float32)
    for b0 in range(0, NB, 8):
        blk = b0 + b8  # [1, 8, 1]
        m3 = rmask[:, None, None] & (blk < NB)
        bp = row + blk * 34
        hw = tl.load((bp + 2).to(tl.pointer_type(tl.int16)) + i16, mask=m3, other=0).to(tl.int32)  # [R, 8, 16]
        lo = (hw << 24) >> 24  # int8 of byte 0 (element 2i), sign-extended
        hi = (hw << 16) >> 24  # byte 1 (element 2i + 1)
        xp = x_row + blk * 32 + 2 * i16  # [1, 8, 16]
        xm = blk < NB
        x0 = tl.load(xp, mask=xm, other=0.0).to(tl.float32)
        x1 = tl.load(xp + 1, mask=xm, other=0.0).to(tl.float32)
        dot = tl.sum(lo.to(tl.float32) * x0 + hi.to(tl.float32) * x1, axis=2)  # [R, 8]
        d = tl.load(bp.to(tl.pointer_type(tl.float16)), mask=m3, other=0.0).to(tl.float32)  # [R, 8, 1]
        acc += tl.reshape(d, [NROWS, 8]) * dot
    return tl.sum(acc, axis=1)
