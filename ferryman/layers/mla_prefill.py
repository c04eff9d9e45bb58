"""MLA prefill in the expanded form, over bounded pieces (layers/mla.py's prefill chunks and mixed steps).

Decode absorbs W_UK into the query and attends against the latents with keys of width
C = Dl + Dr (576 on DeepSeek-V3). A prefill chunk has many queries per sequence, so it expands the
latents instead: per head group, k = [W_UK c ; k_rope] (Dn + Dr = 192 values) and v = W_UV c
(Dv = 128), and runs scaled_dot_product_attention (flash / memory-efficient kernels on GPU) over
query chunks. Same math as the absorbed form, a third of its attention FLOPs, and bounded memory.

Memory bound (beside q and the output, [T, H, Dn + Dr] and [T, H, Dv]): per sequence its gathered
latents [L, C]; per head group of G heads, k and v [L, G, Dn + Dr + Dv]; per query chunk, scores
of at most MAX_SCORE_ELEMS elements (fp32) when the kernel materialises them. For a 4096-token
prompt on DeepSeek-V3 shapes (H = 128, G = 16, bf16): latents 4.5 MiB, k/v 40 MiB, scores
128 MiB, q 192 MiB, output 128 MiB: under 0.5 GiB per MLA layer, where the absorbed torch path
held q, q_latent and its output at C or Dl values per head ([T, H, 576] three times, ~1.7 GiB)
plus fp32 copies of each query chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ferryman.layers.attn_metadata import AttnMetadata

HEAD_GROUP = 16  # heads expanded at once
MAX_SCORE_ELEMS = 1 << 25  # G x query chunk x L scores (128 MiB in fp32)


def gather_latents(cache: Tensor, block_row: Tensor, seq_len: int, dtype: torch.dtype) -> Tensor:
    """The first seq_len cache entries of one sequence, in position order -> [L, C] in `dtype`."""
    # cache: [N, S, 1, C]
    blocks = block_row[: -(-seq_len // cache.shape[1])].long()
    return cache[blocks].flatten(0, 2)[:seq_len].to(dtype)


def causal_mask(first_pos: int, num_q: int, kv_len: int, device: torch.device) -> Tensor:
    """[Q, L] bool: query i (at position first_pos + i) sees keys 0..first_pos + i."""
    q_pos = torch.arange(first_pos, first_pos + num_q, device=device)
    return torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]


def expanded_prefill(q_nope: Tensor, q_rope: Tensor, cache: Tensor, meta: AttnMetadata, w_uk: Tensor,
                     w_uv: Tensor, scale: float) -> Tensor:
    """Causal attention of every query over its sequence's cached entries (this step's included),
    expanded per head group -> [T, H, Dv] in q's dtype. Rows past query_start_loc[-1] are zero."""
    # q_nope: [T, H, Dn]; q_rope: [T, H, Dr] (rotated); w_uk: [H, Dn, Dl]; w_uv: [H, Dv, Dl]
    T, H, _ = q_nope.shape
    latent_dim = w_uk.shape[-1]
    out = q_nope.new_zeros(T, H, w_uv.shape[1])
    starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for b, seq_len in enumerate(seq_lens):
        q_begin, q_end = starts[b], starts[b + 1]
        if q_end == q_begin:
            continue
        first_pos = seq_len - (q_end - q_begin)
        if first_pos < 0:
            raise ValueError(f"seq_lens[{b}]={seq_len} is shorter than its {q_end - q_begin} query tokens")
        entries = gather_latents(cache, meta.block_tables[b], seq_len, q_nope.dtype)  # [L, C]
        latent, k_rope = entries[:, :latent_dim], entries[:, latent_dim:]  # [L, Dl], [L, Dr]
        mask = causal_mask(first_pos, q_end - q_begin, seq_len, q_nope.device)  # [Q, L]
        q = torch.cat((q_nope[q_begin:q_end], q_rope[q_begin:q_end]), dim=-1)  # [Q, H, Dn + Dr]
        for h in range(0, H, HEAD_GROUP):
            heads = slice(h, min(h + HEAD_GROUP, H))
            out[q_begin:q_end, heads] = _head_group(q[:, heads], latent, k_rope, w_uk[heads], w_uv[heads], mask, scale)
    return out


def _head_group(q: Tensor, latent: Tensor, k_rope: Tensor, w_uk: Tensor, w_uv: Tensor, mask: Tensor,
                scale: float) -> Tensor:
    """One head group: expand k, v from the latents and attend in query chunks -> [Q, G, Dv]."""
    # q: [Q, G, Dn + Dr]; latent: [L, Dl]; k_rope: [L, Dr]; w_uk: [G, Dn, Dl]; w_uv: [G, Dv, Dl]
    G, L = q.shape[1], latent.shape[0]
    k_nope = torch.einsum("ld,gnd->gln", latent, w_uk)  # [G, L, Dn]
    k = torch.cat((k_nope, k_rope[None].expand(G, -1, -1)), dim=-1)  # [G, L, Dn + Dr]
    v = torch.einsum("ld,gvd->glv", latent, w_uv)  # [G, L, Dv]
    qh = q.transpose(0, 1)  # [G, Q, Dn + Dr]
    chunk = max(1, MAX_SCORE_ELEMS // (G * L))
    parts = [F.scaled_dot_product_attention(qh[:, c:c + chunk], k, v, attn_mask=mask[c:c + chunk], scale=scale)
             for c in range(0, qh.shape[1], chunk)]  # each [G, chunk, Dv]
    return torch.cat(parts, dim=1).transpose(0, 1)
