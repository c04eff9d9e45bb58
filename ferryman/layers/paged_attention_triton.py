"""Triton paged attention (decode and chunked prefill in one kernel) and the KV write.

A program takes one q tile x one kv head x one kv split. A q tile is BLOCK_Q consecutive query
tokens of one sequence times the G query heads of the kv head, as BLOCK_M = BLOCK_Q * G_PAD rows
(row r = token r // G_PAD, head r % G_PAD), so the scores are one tl.dot per kv block even at
decode. Online softmax (flash attention) in the log2 domain.

No host syncs: tile t of sequence b starts at `query_start_loc[b] // BLOCK_Q + b`, so a static
`T // BLOCK_Q + B` tiles cover any batch and a program finds its sequence by binary search. With
num_splits > 1 each split covers a slice of the kv range and writes (acc, max, sum) partials that
a second kernel merges (flash decoding); the count is a run-time argument, so a new context length
compiles nothing.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ferryman.layers.attn_metadata import AttnMetadata

_LOG2E = tl.constexpr(1.4426950408889634)
# finite "minus infinity" for the running max: exp2(-inf - _NEG_BIG) = 0 without NaNs
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _find_seq(query_start_loc, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The last sequence b whose first tile (query_start_loc[b] // BLOCK_Q + b) is <= tile."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_block(
    m_i, l_i, acc, q_tile, pos, start, kv_end, full_lo, full_hi, k_head, v_head, block_row,
    stride_kn, stride_ks, stride_vn, stride_vs, scale_log2, window,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over kv positions [start, start + BLOCK_N) clipped to kv_end.
    m_i, l_i: [BLOCK_M] running max / sum (log2 domain); acc: [BLOCK_M, D_PAD] unnormalised output;
    k_head/v_head: the cache pointers moved to this kv head; block_row: this sequence's block table.
    Blocks starting in [full_lo, full_hi) are visible to every row and skip the mask."""
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    kv_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    kv_ok = kv_pos < kv_end
    block = tl.load(block_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
    slot_off = kv_pos % BLOCK_SIZE
    k_off = block * stride_kn + slot_off * stride_ks
    k_t = tl.load(k_head + k_off[None, :] + dims[:, None], mask=kv_ok[None, :] & dim_ok[:, None], other=0.0)
    k_t = k_t.to(q_tile.dtype)  # an fp8 cache is read back in q's dtype (a no-op otherwise)
    s = tl.dot(q_tile, k_t, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if (start < full_lo) | (start >= full_hi):
        visible = kv_ok[None, :] & (kv_pos[None, :] <= pos[:, None])
        if USE_WINDOW:
            visible = visible & (kv_pos[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_off = block * stride_vn + slot_off * stride_vs
    v_tile = tl.load(v_head + v_off[:, None] + dims[None, :], mask=kv_ok[:, None] & dim_ok[None, :], other=0.0)
    v_tile = v_tile.to(q_tile.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# No specialisation (and recompile) on values that vary step to step: batch sizes, the split count
# (a new context length must not compile a variant mid-load) and the block-table row stride (an
# eager step's table is as wide as its longest sequence)
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits", "stride_bt"])
def _paged_attn_kernel(
    out, part_acc, part_ml,  # out: [T, Hq, D]; partials: [SPLITS, T, Hq, D_PAD] and [SPLITS, T, Hq, 2]
    q, k_cache, v_cache, sinks,
    query_start_loc, seq_lens, block_tables,
    num_seqs, num_tokens, num_q_heads, scale_log2, window, num_splits,
    stride_qt, stride_qh,
    stride_kn, stride_ks, stride_kh,
    stride_vn, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_begin
    q0 = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # first query (within the sequence) of this tile
    if q0 >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    ctx_len = seq_len - q_len  # kv already cached before this step

    rows = tl.arange(0, BLOCK_M)
    tok = q0 + rows // G_PAD  # [BLOCK_M] query index within the sequence
    head = kv_head * G + rows % G_PAD  # [BLOCK_M] q head
    row_ok = (tok < q_len) & (rows % G_PAD < G)
    pos = ctx_len + tok  # absolute position of each row's query
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM

    # q: [BLOCK_M, D_PAD]
    q_ptrs = q + (q_begin + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q_tile = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # kv range the tile can see: [kv_lo, kv_hi); the window drops blocks left of the first query's
    kv_hi = ctx_len + tl.minimum(q0 + BLOCK_Q, q_len)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx_len + q0 - window + 1, 0) // BLOCK_N * BLOCK_N
    # blocks start at kv_lo + j * BLOCK_N; those ending at or before the first row's position
    # (and, with a window, starting after the last row's position - window) need no mask
    first_pos = ctx_len + q0
    full_lo = kv_lo
    if USE_WINDOW:
        full_lo = kv_lo + tl.maximum(tl.cdiv(kv_hi - window - kv_lo, BLOCK_N), 0) * BLOCK_N
    full_hi = kv_lo + (first_pos + 1 - kv_lo) // BLOCK_N * BLOCK_N
    n_blocks = tl.cdiv(kv_hi - kv_lo, BLOCK_N)
    blocks_per_split = tl.cdiv(n_blocks, num_splits)
    split_lo = kv_lo + split * blocks_per_split * BLOCK_N
    split_hi = tl.minimum(split_lo + blocks_per_split * BLOCK_N, kv_hi)

    # the sink is one more logit with a zero value row: it seeds the running max/sum of split 0
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        if split == 0:
            m_i = tl.load(sinks + head, mask=row_ok, other=_NEG_BIG).to(tl.float32) * _LOG2E
            l_i = tl.where(row_ok, 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    k_head = k_cache + kv_head * stride_kh
    v_head = v_cache + kv_head * stride_vh
    block_row = block_tables + seq * stride_bt

    # the interpreter's range() cannot take tensor bounds (numpy >= 2.4), so it walks the same
    # blocks with a while loop; compiled code keeps the for loop, which Triton software-pipelines
    if INTERPRET:
        start = split_lo
        while start < split_hi:
            m_i, l_i, acc = _attend_block(
                m_i, l_i, acc, q_tile, pos, start, split_hi, full_lo, full_hi, k_head, v_head, block_row,
                stride_kn, stride_ks, stride_vn, stride_vs, scale_log2, window,
                BLOCK_N, HEAD_DIM, D_PAD, BLOCK_SIZE, USE_WINDOW, DOT_PRECISION,
            )
            start += BLOCK_N
    else:
        for start in range(split_lo, split_hi, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                m_i, l_i, acc, q_tile, pos, start, split_hi, full_lo, full_hi, k_head, v_head, block_row,
                stride_kn, stride_ks, stride_vn, stride_vs, scale_log2, window,
                BLOCK_N, HEAD_DIM, D_PAD, BLOCK_SIZE, USE_WINDOW, DOT_PRECISION,
            )

    token = q_begin + tok
    if not SPLIT:  # num_splits == 1: the output directly
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part_row = (split * num_tokens + token) * num_q_heads + head  # [BLOCK_M]
        tl.store(part_acc + part_row[:, None] * D_PAD + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml + part_row * 2, m_i, mask=row_ok)
        tl.store(part_ml + part_row * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _merge_splits_kernel(
    out, part_acc, part_ml,
    num_tokens, num_q_heads, stride_ot, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, MAX_SPLITS)
    used = splits < num_splits  # the rest weigh 0: m = _NEG_BIG, l = 0, acc = 0
    dims = tl.arange(0, D_PAD)
    part_row = (splits * num_tokens + token) * num_q_heads + head  # [MAX_SPLITS]
    m = tl.load(part_ml + part_row * 2, mask=used, other=_NEG_BIG)
    l = tl.load(part_ml + part_row * 2 + 1, mask=used, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.exp2(m - m_all)  # splits that saw no key have m = _NEG_BIG -> weight 0
    denom = tl.sum(l * w, 0)
    acc = tl.load(part_acc + part_row[:, None] * D_PAD + dims[None, :], mask=used[:, None], other=0.0)  # [MAX_SPLITS, D_PAD]
    o = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out + token * stride_ot + head * stride_oh + dims, o.to(out.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def _write_kv_kernel(
    k, v, k_cache, v_cache, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcn, stride_kcs, stride_kch, stride_vcn, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, H_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k_row = tl.load(k + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v_row = tl.load(v + token * stride_vt + heads * stride_vh + dims, mask=mask)
    kc = k_cache + block * stride_kcn + offset * stride_kcs + heads * stride_kch + dims
    vc = v_cache + block * stride_vcn + offset * stride_vcs + heads * stride_vch + dims
    tl.store(kc, k_row.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(vc, v_row.to(v_cache.dtype.element_ty), mask=mask)


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    # k, v: [T, Hkv, D]; caches: [N, S, Hkv, D]
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("kv cache must be contiguous in head_dim")
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, H_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: keep the split path exercised but cheap


MAX_SPLITS = 64  # kv splits of one program's range (the merge kernel's constexpr width)


def _pick_num_splits(num_programs: int, kv_span: int, block_n: int, device: torch.device) -> int:
    """Split the kv range while the grid stays under ~8 programs per SM and each split keeps
    >= 2 kv blocks. Only speed depends on it: any value is correct for any seq_lens, so a graph
    captured with one max_seq_len replays correctly with longer sequences."""
    target = 8 * _num_sms(device)
    splits = 1
    while splits < MAX_SPLITS and num_programs * splits * 2 <= target and splits * 4 * block_n <= kv_span:
        splits *= 2
    return splits


def _tile_config(max_query_len: int, group_pad: int, window: int | None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), tuned at gpt-oss shapes (G=8, D=64): decode-sized
    tiles when every query is alone, smaller ones when a short window bounds the kv."""
    if max_query_len <= 1:
        return max(16, group_pad), 64, 4, 2
    if window is not None and window <= 256:
        return max(64, group_pad), 32, 4, 2
    return max(128, group_pad), 64, 8, 2


def paged_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnMetadata, scale: float,
                           window: int | None = None, sinks: Tensor | None = None,
                           num_splits: int | None = None,
                           tile: tuple[int, int, int, int] | None = None) -> Tensor:
    # q: [T, Hq, D]; caches: [N, S, Hkv, D] -> out: [T, Hq, D]. tile: (BLOCK_M, BLOCK_N, num_warps,
    # num_stages) in place of _tile_config's (benchmarks/bench_prefill_attention.py sweeps them)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_seqs = meta.seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("kv cache must be contiguous in head_dim")
    q = _last_dim_contiguous(q)
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    d_pad = triton.next_power_of_2(head_dim)
    block_m, block_n, num_warps, num_stages = tile or _tile_config(meta.max_query_len, group_pad, window)
    block_q = block_m // group_pad
    # tiles of sequence b start at query_start_loc[b] // BLOCK_Q + b: this many cover any batch
    num_tiles = num_tokens // block_q + num_seqs
    if num_splits is None:
        busy_tiles = min(num_tiles, num_seqs * triton.cdiv(meta.max_query_len, block_q))
        kv_span = meta.max_seq_len if window is None else min(meta.max_seq_len, window + block_q + block_n)
        num_splits = _pick_num_splits(busy_tiles * num_kv_heads, kv_span, block_n, q.device)
    if num_splits < 1 or num_splits & (num_splits - 1) or num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be a power of two in [1, {MAX_SPLITS}], got {num_splits}")

    if num_splits > 1:
        part_acc = torch.empty(num_splits, num_tokens, num_q_heads, d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_splits, num_tokens, num_q_heads, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    sinks_arg = sinks.contiguous() if sinks is not None else q  # unused without sinks
    _paged_attn_kernel[(num_tiles, num_kv_heads, num_splits)](
        out, part_acc, part_ml,
        q, k_cache, v_cache, sinks_arg,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        num_seqs, num_tokens, num_q_heads, scale * _LOG2E.value, window or 0, num_splits,
        q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        out.stride(0), out.stride(1),
        meta.block_tables.stride(0),
        G=group, G_PAD=group_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        SPLIT=num_splits > 1, USE_WINDOW=window is not None, USE_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRET=os.environ.get("TRITON_INTERPRET", "0") == "1",
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_ml, num_tokens, num_q_heads, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, D_PAD=d_pad, MAX_SPLITS=MAX_SPLITS,
        )
    return out
