"""Triton decode over the paged latent cache (mla_attention.py's absorbed form), one query per sequence.

A program takes one sequence x BLOCK_H query heads x one kv split: the heads share every latent
block it loads (keys [c ; k_rope], values c), so the cache is read once per head block. Online
softmax in the log2 domain; each split writes (acc, max, sum) partials and torch merges them, so
the step has no host sync and a captured CUDA graph replays for any seq_lens <= the captured
max_seq_len (the splits cover that many positions).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from ferryman.layers.attn_metadata import AttnMetadata

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max
BLOCK_H, BLOCK_N = 16, 32
MAX_SPLITS = 32


@triton.jit
def _latent_decode_kernel(
    q, cache, part_acc, part_ml,  # q: [B, H, C]; cache: [N, S, 1, C]; partials [SPLITS, B, H, DL_PAD] / [.., 2]
    seq_lens, block_tables,
    num_heads, scale_log2, kv_per_split,
    stride_qt, stride_qh, stride_cn, stride_cs, stride_bt,
    stride_as, stride_at, stride_ah, stride_ms, stride_mt, stride_mh,
    LATENT: tl.constexpr, ROPE: tl.constexpr, DL_PAD: tl.constexpr, DR_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = heads < num_heads
    dl, dr = tl.arange(0, DL_PAD), tl.arange(0, DR_PAD)
    dl_ok, dr_ok = dl < LATENT, dr < ROPE
    q_row = q + seq * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + dl[None, :], mask=h_ok[:, None] & dl_ok[None, :], other=0.0)  # [BLOCK_H, DL_PAD]
    q_rope = tl.load(q_row + LATENT + dr[None, :], mask=h_ok[:, None] & dr_ok[None, :], other=0.0)
    seq_len = tl.load(seq_lens + seq)
    start = split * kv_per_split
    end = tl.minimum(seq_len, start + kv_per_split)
    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DL_PAD], tl.float32)
    for s in range(start, end, BLOCK_N):
        kv_pos = s + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < end
        block = tl.load(block_tables + seq * stride_bt + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        row = cache + block * stride_cn + (kv_pos % BLOCK_SIZE) * stride_cs  # [BLOCK_N] entry starts
        lat = tl.load(row[:, None] + dl[None, :], mask=kv_ok[:, None] & dl_ok[None, :], other=0.0)
        lat = lat.to(q_lat.dtype)  # an fp8 cache is read back in q's dtype
        rope = tl.load(row[:, None] + LATENT + dr[None, :], mask=kv_ok[:, None] & dr_ok[None, :], other=0.0)
        rope = rope.to(q_lat.dtype)
        scores = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION)
        scores += tl.dot(q_rope, tl.trans(rope), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        scores = tl.where(kv_ok[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=DOT_PRECISION)
        m_i = m_new
    a_out = part_acc + split * stride_as + seq * stride_at + heads[:, None] * stride_ah + dl[None, :]
    tl.store(a_out, acc, mask=h_ok[:, None])
    ml_out = part_ml + split * stride_ms + seq * stride_mt + heads * stride_mh
    tl.store(ml_out, m_i, mask=h_ok)
    tl.store(ml_out + 1, l_i, mask=h_ok)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: keep the split path exercised but cheap


def pick_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Split the kv range while the grid stays under ~2 programs per SM and each split keeps >= 4
    kv tiles. Only speed depends on it."""
    splits = 1
    while splits < MAX_SPLITS and num_programs * splits * 2 <= 2 * _num_sms(device) \
            and splits * 8 * BLOCK_N <= max_seq_len:
        splits *= 2
    return splits


def latent_decode_triton(q: Tensor, cache: Tensor, meta: AttnMetadata, scale: float, latent_dim: int,
                         num_splits: int | None = None) -> Tensor:
    # q: [B, H, C] (one query per sequence); cache: [N, S, 1, C] -> [B, H, Dl]
    num_seqs, num_heads, width = q.shape
    if cache.stride(-1) != 1:
        raise ValueError("latent cache must be contiguous in its last dim")
    q = q if q.stride(-1) == 1 else q.contiguous()
    head_blocks = triton.cdiv(num_heads, BLOCK_H)
    if num_splits is None:
        num_splits = pick_splits(num_seqs * head_blocks, meta.max_seq_len, q.device)
    kv_per_split = triton.cdiv(triton.cdiv(max(meta.max_seq_len, 1), num_splits), BLOCK_N) * BLOCK_N
    dl_pad = max(16, triton.next_power_of_2(latent_dim))
    dr_pad = max(16, triton.next_power_of_2(width - latent_dim))
    part_acc = torch.empty(num_splits, num_seqs, num_heads, dl_pad, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(num_splits, num_seqs, num_heads, 2, dtype=torch.float32, device=q.device)
    if num_seqs:
        _latent_decode_kernel[(num_seqs, head_blocks, num_splits)](
            q, cache, part_acc, part_ml, meta.seq_lens, meta.block_tables,
            num_heads, scale * _LOG2E, kv_per_split,
            q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), meta.block_tables.stride(0),
            *part_acc.stride()[:3], *part_ml.stride()[:3],
            LATENT=latent_dim, ROPE=width - latent_dim, DL_PAD=dl_pad, DR_PAD=dr_pad,
            BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_SIZE=cache.shape[1],
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=4, num_stages=2,
        )
    return merge_splits(part_acc[..., :latent_dim], part_ml).to(q.dtype)


def merge_splits(acc: Tensor, ml: Tensor) -> Tensor:
    """Combine per-split (acc [P, B, H, D], (max, sum) [P, B, H, 2], log2 domain) -> [B, H, D] fp32.
    A split past a sequence's end has max -1e30 and sum 0: its weight is 0."""
    m, l = ml[..., 0], ml[..., 1]
    w = torch.exp2(m - m.amax(dim=0, keepdim=True))  # [P, B, H]
    return (acc * w[..., None]).sum(0) / (l * w).sum(0)[..., None]
