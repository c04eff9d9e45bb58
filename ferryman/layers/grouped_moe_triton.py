"""Triton grouped GEMM over slot-indexed expert banks: a CUDA prefill path (fused_moe.prefill_path),
dense weights read as they are, packed ones (MXFP4, fp8 blocks or channels, NVFP4, int4/int8) decoded
inside the weight tiles by their format's tile function (quant/*_triton.py), never dequantised whole.

    `grouped_moe(fmt, banks, x, slot_ids, topk_w, act)`  same contract as `fused_moe`
    kernel 1  h[p] = act(x[t] @ W13[slot]^T + b13[slot])               p = t*K + k, h: [P, I]
    kernel 2  y[p] = (h[p] @ W2[slot]^T + b2[slot]) * topk_w[p]         y: [P, H] fp32
    out[t]   = sum_k y[t*K + k] (torch, k order: independent of which slot holds which expert)

Banks may be strided along the slot dim (the expert-major slot pool); each expert is contiguous.
Pairs are sorted by slot on the device and cut into blocks of BLOCK_M pairs of one slot; program
(block, n-tile) multiplies one weight tile by all the block's rows with `tl.dot`. The grid is a
static bound (cdiv(P, BM) + min(P, S) blocks; unused ones return), so nothing syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferryman.layers.moe_act_triton import ACT_KINDS, gate_up_rows, moe_act
from ferryman.layers.moe_common import (INT_FAMILIES, TRITON_FORMATS, MoEActivation, check_inputs, grouped_reads,
                                        kernel_bank, quant_params)
from ferryman.quant.base import Banks, get_format
from ferryman.quant.fp8_triton import fp8_tile
from ferryman.quant.intq_triton import int_tile
from ferryman.quant.mxfp4_triton import mxfp4_tile
from ferryman.quant.nvfp4_triton import nvfp4_tile


@dataclass(frozen=True)
class GroupedConfig:
    block_m: int = 16  # pairs per block; tl.dot needs >= 16
    block_n: int = 32  # output columns per program
    block_k: int = 64  # reduction step; a multiple of 32 keeps mxfp4 scale groups whole
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GroupedConfig.{name} must be a power of two >= 16, got {v}")
        if self.block_k < 32:
            raise ValueError(f"GroupedConfig.block_k must be >= 32 (one MXFP4 scale group), got {self.block_k}")


@triton.jit
def _w_tile(w_base, s_base, g_base, z_base, rows, rmask, k0, kk, kmask, KDIM: tl.constexpr, PART_ROWS: tl.constexpr,
            MXFP4: tl.constexpr, QF: tl.constexpr, QA: tl.constexpr, QB: tl.constexpr, R: tl.constexpr,
            BK: tl.constexpr):
    # rows [R] of one expert's weight [OUT, KDIM] at columns kk = k0 + [0, BK) -> fp32 [R, BK] (0
    # outside), decoded by the format's tile function (quant/*_triton.py). QF / QA / QB as the decode
    # kernel's (layers/moe_common.py quant_params): 1 fp8, 2 nvfp4, 3 int; 0 dense or MXFP4. Row r of
    # the weight belongs to part r // PART_ROWS (w13: gate, up) for nvfp4's global scales and int's
    # group indices.
    if MXFP4:
        return mxfp4_tile(w_base, s_base, rows, rmask, k0, KDIM, R, BK)
    elif QF == 1:
        return fp8_tile(w_base, s_base, rows, rmask, k0, KDIM, R, BK, QA, QB)
    elif QF == 2:
        return nvfp4_tile(w_base, s_base, g_base, rows, rmask, k0, KDIM, R, BK, PART_ROWS, QA)
    elif QF == 3:
        return int_tile(w_base, s_base, z_base, g_base, rows, rmask, k0, KDIM, R, BK, QA, QB, PART_ROWS)
    else:
        m2 = rmask[:, None] & kmask[None, :]
        return tl.load(w_base + rows[:, None] * KDIM + kk[None, :], mask=m2, other=0.0).to(tl.float32)


@triton.jit
def _dot(a, w, FP32: tl.constexpr):
    # a [M, BK] x w [N, BK] -> [M, N] fp32; weights rounded to the compute dtype like the reference
    if FP32:
        return tl.dot(a, tl.trans(w), input_precision="ieee")
    return tl.dot(a, tl.trans(w.to(a.dtype)))


@triton.jit
def _bases(w_ptr, s_ptr, g_ptr, z_ptr, slot, w_stride, s_stride, g_stride, z_stride):
    # expert `slot`'s start in each of the four banks (strided along the slot dim: the slot pool)
    return w_ptr + slot * w_stride, s_ptr + slot * s_stride, g_ptr + slot * g_stride, z_ptr + slot * z_stride


@triton.jit
def _a_tile(a_ptr, a_rows, rmask, k0, KDIM: tl.constexpr, BK: tl.constexpr):
    # rows a_rows [BM] of activations [*, KDIM] at columns kk = k0 + [0, BK) -> ([BM, BK] (0 outside), kk, kmask)
    kk = k0 + tl.arange(0, BK)
    kmask = kk < KDIM
    a = tl.load(a_ptr + a_rows[:, None] * KDIM + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    return a, kk, kmask


@triton.jit
def _w13_grouped(x_ptr, order_ptr, bslot_ptr, brow_ptr, bend_ptr, w_ptr, s_ptr, g_ptr, z_ptr, b_ptr, h_ptr, alpha,
                 limit, w_stride, s_stride, b_stride, g_stride, z_stride, H: tl.constexpr, I: tl.constexpr,
                 TOPK: tl.constexpr, ACT: tl.constexpr, MXFP4: tl.constexpr, QF: tl.constexpr, QA: tl.constexpr,
                 QB: tl.constexpr, HAS_BIAS: tl.constexpr, FP32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    blk = tl.program_id(0)
    slot = tl.load(bslot_ptr + blk).to(tl.int64)
    if slot < 0:
        return
    r = tl.load(brow_ptr + blk) + tl.arange(0, BM)  # sorted-pair rows of this block
    rmask = r < tl.load(bend_ptr + blk)
    pair = tl.load(order_ptr + r, mask=rmask, other=0)  # [BM]
    tok = pair // TOPK
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < I
    g_rows, u_rows = gate_up_rows(n, I, ACT)
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    w_base, s_base, g_base, z_base = _bases(w_ptr, s_ptr, g_ptr, z_ptr, slot, w_stride, s_stride, g_stride, z_stride)
    for k0 in range(0, H, BK):
        a, kk, kmask = _a_tile(x_ptr, tok, rmask, k0, H, BK)
        # w13 rows [0, I) are the gate's part, [I, 2I) the up's (swiglu_oai interleaves within each)
        w_g = _w_tile(w_base, s_base, g_base, z_base, g_rows, nmask, k0, kk, kmask, H, I, MXFP4, QF, QA, QB, BN, BK)
        acc_g += _dot(a, w_g, FP32)
        w_u = _w_tile(w_base, s_base, g_base, z_base, u_rows, nmask, k0, kk, kmask, H, I, MXFP4, QF, QA, QB, BN, BK)
        acc_u += _dot(a, w_u, FP32)
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + slot * b_stride + g_rows, mask=nmask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + slot * b_stride + u_rows, mask=nmask, other=0.0).to(tl.float32)[None, :]
    dt = h_ptr.dtype.element_ty  # round gate_up like the reference, which holds it in x.dtype
    h = moe_act(acc_g.to(dt).to(tl.float32), acc_u.to(dt).to(tl.float32), alpha, limit, ACT)
    tl.store(h_ptr + pair[:, None] * I + n[None, :], h.to(dt), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _w2_grouped(h_ptr, order_ptr, bslot_ptr, brow_ptr, bend_ptr, w_ptr, s_ptr, g_ptr, z_ptr, b_ptr, tw_ptr, y_ptr,
                w_stride, s_stride, b_stride, g_stride, z_stride, H: tl.constexpr, I: tl.constexpr,
                MXFP4: tl.constexpr, QF: tl.constexpr, QA: tl.constexpr, QB: tl.constexpr, HAS_BIAS: tl.constexpr,
                FP32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    blk = tl.program_id(0)
    slot = tl.load(bslot_ptr + blk).to(tl.int64)
    if slot < 0:
        return
    r = tl.load(brow_ptr + blk) + tl.arange(0, BM)
    rmask = r < tl.load(bend_ptr + blk)
    pair = tl.load(order_ptr + r, mask=rmask, other=0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # output features
    nmask = n < H
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    w_base, s_base, g_base, z_base = _bases(w_ptr, s_ptr, g_ptr, z_ptr, slot, w_stride, s_stride, g_stride, z_stride)
    for k0 in range(0, I, BK):
        a, kk, kmask = _a_tile(h_ptr, pair, rmask, k0, I, BK)
        w = _w_tile(w_base, s_base, g_base, z_base, n, nmask, k0, kk, kmask, I, H, MXFP4, QF, QA, QB, BN, BK)
        acc += _dot(a, w, FP32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + slot * b_stride + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(tw_ptr + pair, mask=rmask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + pair[:, None] * H + n[None, :], acc, mask=rmask[:, None] & nmask[None, :])


def _blocks(slot_ids: torch.Tensor, num_slots: int, bm: int) -> tuple[torch.Tensor, ...]:
    """Pairs sorted by slot, cut into blocks of <= bm pairs of one slot, on the device: (order [P],
    block slot [NB] (-1 = unused), first row [NB], end row [NB]), NB = cdiv(P, bm) + min(P, S)."""
    flat = slot_ids.reshape(-1).long()  # [P]
    p = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_slots, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    nblk = (counts + bm - 1) // bm  # [S]
    blk_end = torch.cumsum(nblk, 0)
    row_end = torch.cumsum(counts, 0)
    nb = -(-p // bm) + min(p, num_slots)
    b = torch.arange(nb, device=flat.device)
    e = torch.searchsorted(blk_end, b, right=True)  # slot of block b; S past the last block
    ec = e.clamp(max=num_slots - 1)
    first = row_end[ec] - counts[ec] + (b - (blk_end[ec] - nblk[ec])) * bm
    slot = torch.where(e < num_slots, ec, torch.full_like(ec, -1))
    return order, slot, first, row_end[ec]


def grouped_moe(fmt: str, banks: Banks, x: torch.Tensor, slot_ids: torch.Tensor, topk_w: torch.Tensor,
                act: MoEActivation, cfg: GroupedConfig = GroupedConfig()) -> torch.Tensor:
    """x [T, H], slot_ids / topk_w [T, K] -> [T, H] in x.dtype."""
    if not grouped_reads(fmt):
        raise ValueError(f"grouped_moe: no kernel for expert format {fmt!r}; have {', '.join(TRITON_FORMATS)} "
                         f"and the families {', '.join(INT_FAMILIES)}, fp8")
    num_slots, hidden, inter = get_format(fmt).dims(banks)
    check_inputs(x, slot_ids, topk_w, hidden)
    t, k = slot_ids.shape
    pairs = t * k
    x = x.contiguous()
    tw = topk_w.reshape(-1).contiguous()  # [P]
    w13, w2 = kernel_bank(fmt, banks, "w13", x), kernel_bank(fmt, banks, "w2", x)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # [P, I]
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    order, bslot, first, end = _blocks(slot_ids, num_slots, cfg.block_m)
    tiles = dict(MXFP4=fmt == "mxfp4", **quant_params(fmt), HAS_BIAS=w13.has_bias, FP32=x.dtype == torch.float32,
                 BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, num_warps=cfg.num_warps)
    _w13_grouped[(bslot.numel(), triton.cdiv(inter, cfg.block_n))](
        x, order, bslot, first, end, w13.w, w13.s, w13.g, w13.z, w13.b, h, float(act.alpha), float(act.limit),
        *w13.strides, w13.g_stride, w13.z_stride, H=hidden, I=inter, TOPK=k, ACT=ACT_KINDS[act.kind], **tiles)
    _w2_grouped[(bslot.numel(), triton.cdiv(hidden, cfg.block_n))](
        h, order, bslot, first, end, w2.w, w2.s, w2.g, w2.z, w2.b, tw, y, *w2.strides, w2.g_stride, w2.z_stride,
        H=hidden, I=inter, **tiles)
    return y.view(t, k, hidden).sum(dim=1).to(x.dtype)  # [T, H]
