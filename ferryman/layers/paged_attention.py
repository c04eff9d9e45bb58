"""Paged attention over a block KV cache (layout: attn_metadata.py): public API and the torch reference.

Shapes: T = tokens in the step, B = sequences, Hq/Hkv = query/kv heads (G = Hq // Hkv query heads
share one kv head), D = head_dim, L = kv length of a sequence. Query token i of sequence b sits at
position `seq_lens[b] - qlen_b + i`; it sees kv positions p <= pos, and with a sliding window w only
p > pos - w. Sinks (gpt-oss): one logit per q head joins the softmax denominator. Softmax runs in
fp32; the output has q's dtype. The Triton kernel runs where `backend.attention_triton` says; on
the CPU a sequence's prompt rows go through torch's flash attention (paged_attention_torch.py),
its decode row and every row of the reference through dense scores.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ferryman.layers import backend
from ferryman.layers.attn_metadata import AttnMetadata
from ferryman.layers.paged_attention_torch import MIN_QUERIES as FLASH_MIN_QUERIES
from ferryman.layers.paged_attention_torch import attend_sequence
from ferryman.layers.paged_attention_torch import available as flash_available

__all__ = ["AttnMetadata", "write_kv", "paged_attention", "write_kv_reference", "paged_attention_reference"]

# the fp8 KV cache's storage (kv_cache_dtype fp8): written with a saturating cast, read back into
# q's dtype (Triton) or fp32 (the reference)
FP8_KV = torch.float8_e4m3fn

# the reference materialises [Hq, chunk, L] fp32 scores; this bounds chunk * L * Hq
_REF_MAX_SCORE_ELEMS = 1 << 25


def _check_cache(k_cache: Tensor, v_cache: Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [N, S, Hkv, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype or v_cache.device != k_cache.device:
        raise ValueError("k_cache and v_cache must share dtype and device")


def _check_write_inputs(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    _check_cache(k_cache, v_cache)
    kv_shape = (k.shape[0],) + tuple(k_cache.shape[2:])
    if k.dim() != 3 or tuple(k.shape) != kv_shape or tuple(v.shape) != kv_shape:
        raise ValueError(f"k and v must be [T, Hkv, D] = {kv_shape}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype.is_floating_point:
        raise ValueError(f"slot_mapping must be an integer tensor, got {slot_mapping.dtype}")


def _check_attn_inputs(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnMetadata, window: int | None,
                       sinks: Tensor | None) -> None:
    _check_cache(k_cache, v_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"q head_dim {head_dim} != k_cache head_dim {k_cache.shape[3]}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if k_cache.dtype not in (q.dtype, FP8_KV):
        raise ValueError(f"kv cache dtype {k_cache.dtype} must be q's ({q.dtype}) or {FP8_KV}")
    num_seqs = meta.seq_lens.shape[0]
    if meta.query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [B+1={num_seqs + 1}], got {tuple(meta.query_start_loc.shape)}")
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [B={num_seqs}, max_blocks], got {tuple(meta.block_tables.shape)}")
    if window is not None and window <= 0:
        raise ValueError(f"sliding window must be a positive int or None, got {window}")
    if sinks is not None and tuple(sinks.shape) != (num_q_heads,):
        raise ValueError(f"sinks must be [Hq={num_q_heads}], got shape {tuple(sinks.shape)}")


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store the step's k/v ([T, Hkv, D]) at `slot_mapping` (block * S + offset; -1 = skip)."""
    _check_write_inputs(k, v, k_cache, v_cache, slot_mapping)
    if backend.attention_triton(k.device):
        from ferryman.layers.paged_attention_triton import write_kv_triton

        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_reference(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnMetadata, scale: float,
                    window: int | None = None, sinks: Tensor | None = None) -> Tensor:
    """Causal attention of the step's queries q: [T, Hq, D] over the paged cache -> [T, Hq, D]. Rows
    of tokens past query_start_loc[-1] (padding of a CUDA graph) are left unspecified."""
    _check_attn_inputs(q, k_cache, v_cache, meta, window, sinks)
    if backend.attention_triton(q.device):
        from ferryman.layers.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale, window, sinks)
    return _per_sequence(q, k_cache, v_cache, meta, scale, window, sinks,
                         flash=q.device.type == "cpu" and flash_available())  # torch's flash for CPU


def write_kv_reference(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    block_size = k_cache.shape[1]
    # slots < 0 are padding tokens: they write nothing (boolean indexing syncs; fine off-GPU)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def _gather_seq_kv(cache: Tensor, block_row: Tensor, seq_len: int) -> Tensor:
    """The first seq_len kv rows of one sequence, in position order -> [L, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_row[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def _visible(q_pos: Tensor, kv_len: int, window: int | None) -> Tensor:
    """[Q, L] bool: key p is visible to the query at q_pos iff p <= q_pos (and p > q_pos - window)."""
    kv_pos = torch.arange(kv_len, device=q_pos.device)
    mask = kv_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= kv_pos[None, :] > q_pos[:, None] - window
    return mask


def _attend(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, window: int | None,
            sinks: Tensor | None) -> Tensor:
    """Dense attention of q: [Q, Hq, D] over k, v: [L, Hkv, D] (fp32 math) -> [Q, Hq, D] in q.dtype."""
    num_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    # q head h uses kv head h // group (transformers' repeat_kv order)
    qf = q.float().view(num_q, num_kv_heads, group, head_dim)
    scores = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * scale  # [Hkv, G, Q, L]
    scores.masked_fill_(~_visible(q_pos, k.shape[0], window), float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, num_q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())
    return out.reshape(num_q, num_q_heads, head_dim).to(q.dtype)


def paged_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnMetadata, scale: float,
                              window: int | None = None, sinks: Tensor | None = None) -> Tensor:
    """Torch reference (inputs checked by `paged_attention`): per sequence, gather kv from the block
    table and attend."""
    return _per_sequence(q, k_cache, v_cache, meta, scale, window, sinks, flash=False)


def _per_sequence(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnMetadata, scale: float,
                  window: int | None, sinks: Tensor | None, flash: bool) -> Tensor:
    """Each sequence's rows: torch's flash attention (paged_attention_torch.py) for a sequence of at
    least FLASH_MIN_QUERIES rows when `flash`, else the reference's dense scores."""
    out = torch.zeros_like(q)
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for b, seq_len in enumerate(seq_lens):
        q_begin, q_end = starts[b], starts[b + 1]
        if q_end == q_begin:
            continue
        k = _gather_seq_kv(k_cache, meta.block_tables[b], seq_len)
        v = _gather_seq_kv(v_cache, meta.block_tables[b], seq_len)
        first_pos = seq_len - (q_end - q_begin)
        if first_pos < 0:
            raise ValueError(f"seq_lens[{b}]={seq_len} is shorter than its {q_end - q_begin} query tokens")
        if flash and q_end - q_begin >= FLASH_MIN_QUERIES:
            out[q_begin:q_end] = attend_sequence(q[q_begin:q_end], k, v, scale, window, sinks)
            continue
        # bound the [Hq, chunk, L] score tensor so long prefills stay within memory
        chunk = max(1, _REF_MAX_SCORE_ELEMS // max(1, seq_len * q.shape[1]))
        for c in range(q_begin, q_end, chunk):
            c_end = min(c + chunk, q_end)
            q_pos = torch.arange(c - q_begin, c_end - q_begin, device=q.device) + first_pos
            out[c:c_end] = _attend(q[c:c_end], k, v, q_pos, scale, window, sinks)
    return out
