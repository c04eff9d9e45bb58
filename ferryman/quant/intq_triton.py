"""Triton kernels of the int expert formats (quant/intq.py): the dequantiser of the batched prefill
path, reading the slot banks in place, the decode GEMV's tile loader (`int_rows_dot`, called from
layers/fused_moe_triton.py), which reads the packed words directly, and the grouped prefill GEMM's
weight tile (`int_tile`, layers/grouped_moe_triton.py).

Both compute what `IntFormat.dequant` defines: (code - zero) x scale in fp32; the dequantiser then
rounds once to the output dtype, exactly as the reference. The GEMV sums code differences times x
per group and scales each group's sum once (or, with a group index per input, scales per input).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferryman.quant.bank_slots import program_slot, rows_contiguous, slot_span


@triton.jit
def _codes(words, BITS: tl.constexpr, R: tl.constexpr, W: tl.constexpr):
    # words [R, W] int32 -> codes [R, W * 32/BITS] int32: input k = w*P + j at bits j*BITS of word w
    P: tl.constexpr = 32 // BITS
    shifts = tl.arange(0, P) * BITS
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, [R, W * P])


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, z_ptr, g_ptr, idx_ptr, out_ptr, slot0, q_stride, s_stride, z_stride, g_stride,
                    OUT: tl.constexpr, K: tl.constexpr, NG: tl.constexpr, GS: tl.constexpr, PART_ROWS: tl.constexpr,
                    BITS: tl.constexpr, ASYM: tl.constexpr, ACT: tl.constexpr, HAS_IDX: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (i, r, j): rows i*BLOCK_R.., inputs j*BLOCK_K.. of bank row idx[r] (HAS_IDX) or slot0 + r
    r, slot = program_slot(idx_ptr, slot0, HAS_IDX)
    P: tl.constexpr = 32 // BITS
    W: tl.constexpr = BLOCK_K // P
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < OUT
    wi = tl.program_id(2) * W + tl.arange(0, W)
    m = rmask[:, None] & (wi < K // P)[None, :]
    words = tl.load(q_ptr + slot * q_stride + rows[:, None] * (K // P) + wi[None, :], mask=m, other=0)
    q = _codes(words, BITS, BLOCK_R, W)  # [R, BK]
    k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    mk = rmask[:, None] & (k < K)[None, :]
    if ACT:
        grp = tl.load(g_ptr + slot * g_stride + (rows // PART_ROWS)[:, None] * K + k[None, :], mask=mk, other=0)
    else:
        grp = (k // GS)[None, :] + tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.int32)
    s = tl.load(s_ptr + slot * s_stride + rows[:, None] * NG + grp, mask=mk, other=0.0)
    if ASYM:
        z = tl.load(z_ptr + slot * z_stride + rows[:, None] * NG + grp, mask=mk, other=0).to(tl.int32)
    else:
        z = 1 << (BITS - 1)
    val = (q - z).to(tl.float32) * s
    dst = out_ptr + (r.to(tl.int64) * OUT + rows[:, None]) * K + k[None, :]
    tl.store(dst, val.to(out_ptr.dtype.element_ty), mask=mk)


def dequant_int_rows(bits: int, group: int, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     gidx: torch.Tensor | None, idx: torch.Tensor | slice, dtype: torch.dtype,
                     block_r: int = 16, block_k: int = 256) -> torch.Tensor:
    """Experts `idx` of banks qweight [E, out, K/P], scales [E, out, G], zeros (asym) [E, out, G],
    gidx (act) [E, parts, K] -> [n, out, K] in `dtype`, read in place (one launch). idx: a step-1
    slice or a 1-D int tensor on the banks' device."""
    banks = [qweight, scales, zeros, gidx]
    if not all(t is None or rows_contiguous(t) for t in banks) or (isinstance(idx, slice) and idx.step not in (None, 1)):
        banks = [None if t is None else t[idx].contiguous() for t in banks]
        qweight, scales, zeros, gidx = banks
        idx = slice(0, qweight.shape[0])
    e, out, words = qweight.shape
    k = words * (32 // bits)
    n, slot0, index = slot_span(idx, e, qweight.device, "int")
    res = torch.empty((n, out, k), dtype=dtype, device=qweight.device)
    if n == 0 or out == 0:
        return res
    stand_in = scales
    z, g = (zeros if zeros is not None else stand_in), (gidx if gidx is not None else stand_in)
    grid = (triton.cdiv(out, block_r), n, triton.cdiv(k, block_k))
    _dequant_kernel[grid](qweight, scales, z, g, index if index is not None else qweight, res, slot0,
                          qweight.stride(0), scales.stride(0), z.stride(0), g.stride(0),
                          OUT=out, K=k, NG=scales.shape[2], GS=group or k,
                          PART_ROWS=out // gidx.shape[1] if gidx is not None else out, BITS=bits,
                          ASYM=zeros is not None, ACT=gidx is not None, HAS_IDX=index is not None,
                          BLOCK_R=block_r, BLOCK_K=block_k)
    return res


@triton.jit
def _int_codes(q_base, rows, rmask, k0, KDIM: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, QA: tl.constexpr):
    # words [rows, KDIM/P] (P = 32 / bits inputs a word, bits = QA % 16: quant_code) -> codes [R, BK]
    # int32 of rows [R] at inputs k = k0 + [0, BK) (0 outside), and k; BK a multiple of P, k0 of BK.
    # The offsets come before the load, where the decode loop had them (its sm_90 code is unchanged).
    BITS: tl.constexpr = QA % 16
    P: tl.constexpr = 32 // BITS
    wi = k0 // P + tl.arange(0, BK // P)  # [BK/P] words
    offs_k = tl.arange(0, BK)
    words = tl.load(q_base + rows[:, None] * (KDIM // P) + wi[None, :],
                    mask=rmask[:, None] & (wi < KDIM // P)[None, :], other=0)
    return _codes(words, BITS, R, BK // P), k0 + offs_k


@triton.jit
def _int_zeros(z_ptrs, mask, QA: tl.constexpr):
    # zero points at z_ptrs: the bank's (asym, QA bit 4; uint8 -> int32), or the symmetric zero 2^(bits-1)
    if (QA // 16) % 2:
        return tl.load(z_ptrs, mask=mask, other=0).to(tl.int32)
    return tl.zeros(z_ptrs.shape, dtype=tl.int32) + (1 << (QA % 16 - 1))


@triton.jit
def int_rows_dot(q_base, s_base, z_base, g_base, rows, rmask, x_row, KDIM: tl.constexpr, NROWS: tl.constexpr,
                 BLOCK_K: tl.constexpr, QA: tl.constexpr, GS: tl.constexpr, PART_ROWS: tl.constexpr):
    # rows: [R] weight rows of one expert; q_base -> words [rows, KDIM/P] (_int_codes); s_base/z_base -> [rows, NG]
    # (NG = KDIM/GS; GS 0: one group per row); g_base -> gidx [parts, KDIM] (act), row r in part
    # r // PART_ROWS; x_row -> [KDIM]. QA: bits | asym << 4 | act << 5 (quant_code).
    # Without act and with GS 0 or a power of two, each run of GSTEP inputs shares one group: its
    # code differences times x are summed, then scaled once; otherwise each input is scaled.
    # Returns [R] fp32 dot products.
    ACT: tl.constexpr = QA // 32
    NG: tl.constexpr = KDIM // GS if GS > 0 else 1
    RUN: tl.constexpr = (GS if GS < BLOCK_K else BLOCK_K) if GS > 0 and (GS & (GS - 1)) == 0 else 0
    GSTEP: tl.constexpr = 0 if ACT else (BLOCK_K if GS == 0 else RUN)
    acc = tl.zeros([NROWS], dtype=tl.float32)
    for k0 in range(0, KDIM, BLOCK_K):
        q, k = _int_codes(q_base, rows, rmask, k0, KDIM, NROWS, BLOCK_K, QA)  # [R, BK], [BK]
        kmask = k < KDIM
        x = tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32)  # [BK], 0 past KDIM
        if GSTEP > 0:
            NS: tl.constexpr = BLOCK_K // GSTEP
            j = tl.arange(0, NS)
            if GS > 0:
                grp = tl.minimum((k0 + j * GSTEP) // GS, NG - 1)  # [NS]
            else:
                grp = j * 0
            m2 = rmask[:, None] & ((k0 + j * GSTEP) < KDIM)[None, :]
            s = tl.load(s_base + rows[:, None] * NG + grp[None, :], mask=m2, other=0.0)  # [R, NS]
            z = _int_zeros(z_base + rows[:, None] * NG + grp[None, :], m2, QA)
            d = tl.reshape(q, [NROWS, NS, GSTEP]) - z[:, :, None]
            part = tl.sum(d.to(tl.float32) * tl.reshape(x, [NS, GSTEP])[None, :, :], axis=2)  # [R, NS]
            acc += tl.sum(part * s, axis=1)
        else:
            mk = rmask[:, None] & kmask[None, :]
            if ACT:
                grp2 = tl.load(g_base + (rows // PART_ROWS)[:, None] * KDIM + k[None, :], mask=mk, other=0)
            else:
                grp2 = (k // GS)[None, :] + tl.zeros([NROWS, BLOCK_K], dtype=tl.int32)
            s2 = tl.load(s_base + rows[:, None] * NG + grp2, mask=mk, other=0.0)
            z2 = _int_zeros(z_base + rows[:, None] * NG + grp2, mk, QA)
            acc += tl.sum((q - z2).to(tl.float32) * s2 * x[None, :], axis=1)
    return acc


@triton.jit
def int_tile(q_base, s_base, z_base, g_base, rows, rmask, k0, KDIM: tl.constexpr, R: tl.constexpr,
             BK: tl.constexpr, QA: tl.constexpr, GS: tl.constexpr, PART_ROWS: tl.constexpr):
    # the grouped GEMM's weight tile (layers/grouped_moe_triton.py): rows [R] of one expert's int
    # weight [OUT, KDIM] at inputs [k0, k0 + BK) -> fp32 (code - zero) x scale [R, BK] (0 outside),
    # exactly `IntFormat.dequant`'s values before its rounding. Banks and QA / GS / PART_ROWS as in
    # int_rows_dot; BK a multiple of 32 / bits, k0 a multiple of BK. A scale (and zero) per row when
    # the tile lies in one group (GS 0, or GS a multiple of BK); per run of GS inputs when BK is a
    # multiple of GS; else (act order, odd group sizes) gathered per input.
    ACT: tl.constexpr = QA // 32
    NG: tl.constexpr = KDIM // GS if GS > 0 else 1
    q, k = _int_codes(q_base, rows, rmask, k0, KDIM, R, BK, QA)  # [R, BK], [BK]
    if ACT == 0 and (GS == 0 or GS % BK == 0):
        GDIV: tl.constexpr = GS if GS > 0 else KDIM  # GS 0: k0 // KDIM = group 0
        soff = rows * NG + k0 // GDIV  # [R]
        s = tl.load(s_base + soff, mask=rmask, other=0.0)
        z = _int_zeros(z_base + soff, rmask, QA)
        return (q - z[:, None]).to(tl.float32) * s[:, None]
    elif ACT == 0 and BK % GS == 0:
        NS: tl.constexpr = BK // GS
        grp = k0 // GS + tl.arange(0, NS)  # [NS]
        m2 = rmask[:, None] & (grp < NG)[None, :]
        soff2 = rows[:, None] * NG + grp[None, :]  # [R, NS]
        s2 = tl.load(s_base + soff2, mask=m2, other=0.0)
        z2 = _int_zeros(z_base + soff2, m2, QA)
        d = (tl.reshape(q, [R, NS, GS]) - z2[:, :, None]).to(tl.float32)
        return tl.reshape(d * s2[:, :, None], [R, BK])
    else:
        mk = rmask[:, None] & (k < KDIM)[None, :]
        if ACT:
            grp3 = tl.load(g_base + (rows // PART_ROWS)[:, None] * KDIM + k[None, :], mask=mk, other=0)
        else:
            grp3 = (k // GS)[None, :] + tl.zeros([R, BK], dtype=tl.int32)
        soff3 = rows[:, None] * NG + grp3  # [R, BK]
        s3 = tl.load(s_base + soff3, mask=mk, other=0.0)
        z3 = _int_zeros(z_base + soff3, mk, QA)
        return (q - z3).to(tl.float32) * s3
