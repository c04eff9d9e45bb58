"""Paged attention over a latent KV cache (multi-head latent attention, layers/mla.py).

Each token's cache entry is one "head" of C = kv_lora_rank (Dl) + qk_rope_head_dim values: the
normalised latent c, then the rotated rope key. In the absorbed form every query head h attends
with q_h = [W_UK,h^T q_nope,h ; q_rope,h] (C values) against the entries, and its output is the
softmax-weighted sum of the latents (Dl values), which the layer maps through W_UV. So the cache
is one kv head shared by all H query heads, with keys of width C and values its first Dl columns.

Shapes: T = tokens in the step, H = query heads, C = cache width, Dl = latent width; the block
layout and `AttnMetadata` are paged attention's (attn_metadata.py), with a cache [N, S, 1, C].
"""

from __future__ import annotations

import torch
from torch import Tensor

from ferryman.layers import backend
from ferryman.layers.attn_metadata import AttnMetadata
from ferryman.layers.paged_attention import FP8_KV, paged_attention_reference, write_kv


def _check_cache(cache: Tensor, width: int) -> None:
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != width:
        raise ValueError(f"latent cache must be [N, S, 1, {width}], got shape {tuple(cache.shape)}")


def write_latent(entry: Tensor, cache: Tensor, slot_mapping: Tensor) -> None:
    """Store the step's entries ([T, C]: latent then rope key) at `slot_mapping` (-1 = skip)."""
    _check_cache(cache, entry.shape[-1])
    e = entry.reshape(entry.shape[0], 1, entry.shape[-1])
    # paged attention's writer stores a (k, v) pair; the latent cache is both, written once each
    write_kv(e, e, cache, cache, slot_mapping)


def latent_attention(q: Tensor, cache: Tensor, meta: AttnMetadata, scale: float, latent_dim: int) -> Tensor:
    """Absorbed attention of q: [T, H, C] over the latent cache [N, S, 1, C] -> [T, H, Dl] (q's
    dtype): causal, the softmax in fp32. Rows past query_start_loc[-1] are left unspecified."""
    _check_cache(cache, q.shape[-1])
    if cache.dtype not in (q.dtype, FP8_KV):
        raise ValueError(f"latent cache dtype {cache.dtype} must be q's ({q.dtype}) or {FP8_KV}")
    # decode steps (one query per sequence, graph padding included) take the Triton kernel; prefill
    # chunks and mixed steps the torch path
    one_query_each = meta.max_query_len <= 1 and q.shape[0] == meta.seq_lens.shape[0]
    if backend.attention_triton(q.device) and one_query_each:
        from ferryman.layers.mla_triton import latent_decode_triton

        return latent_decode_triton(q, cache, meta, scale, latent_dim)
    return latent_attention_reference(q, cache, meta, scale, latent_dim)


def latent_attention_reference(q: Tensor, cache: Tensor, meta: AttnMetadata, scale: float,
                               latent_dim: int) -> Tensor:
    """Torch path: paged attention's reference with the cache as both keys and values (values are
    its first Dl columns; the rope columns of the output are dropped)."""
    return paged_attention_reference(q, cache, cache, meta, scale)[..., :latent_dim]
