"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), the absorbed form over a latent cache.

Per token: q = q_b(norm(q_a(x))) (or q_proj(x)), split per head into q_nope [Dn] and q_rope [Dr];
kv_a_proj_with_mqa(x) = [latent c (Dl) ; k_rope (Dr)], c normalised; kv_b_proj maps c to each
head's k_nope [Dn] and v [Dv]: its weight is [H, Dn + Dv, Dl] = [W_UK ; W_UV] per head.

Invariant: the cache holds only [c ; rope(k_rope)] per token (C = Dl + Dr values, one "head"),
never k or v. Scores use q_nope . (W_UK c) = (W_UK^T q_nope) . c, so every step absorbs q_nope
into W_UK once and attends against the latents (mla_attention.py); the output is W_UV applied to
the attention-weighted latent. Steps with more than one query per sequence (prefill chunks, mixed
steps) expand the latents per head group instead (mla_prefill.py): fewer FLOPs and bounded memory;
the expanded K/V live only within that call, never in the cache.
"""

from __future__ import annotations

import torch
from torch import nn

from ferryman.config import MLAConfig, ModelConfig
from ferryman.layers.attn_metadata import AttnMetadata
from ferryman.layers.mla_attention import latent_attention, write_latent
from ferryman.layers.mla_prefill import expanded_prefill
from ferryman.layers.norms import RMSNorm
from ferryman.layers.rotary import RotaryEmbedding

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the reference builds them with the default eps


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., (x0, x1), (x2, x3), ...] -> [..., x0, x2, ..., x1, x3, ...]: interleaved rope pairs in
    rotate-half order (the reference's output layout for rope_interleave)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """One MLA layer. The runner binds `k_cache` ([N, S, 1, C]) before use; `v_cache` stays None."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        if cfg.mla is None:
            raise ValueError(f"layer {layer}: multi-head latent attention needs ModelConfig.mla")
        m: MLAConfig = cfg.mla
        self.mla, self.num_heads, H = m, cfg.num_heads, cfg.num_heads
        bias = cfg.attention_bias
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, H * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, m.cache_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * m.v_head_dim, cfg.hidden_size, bias=bias)
        self.rotary = rotary
        self.window = None  # MLA layers attend to the whole context
        self.window_pool = False
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    separate_values = False  # the latent cache serves as keys and values: no v_cache

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, 1, self.mla.cache_dim)

    def queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_nope [T, H, Dn], q_rope [T, H, Dr] before rotation) of x: [T, hidden]."""
        m = self.mla
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(x.shape[0], self.num_heads, m.qk_head_dim)
        return q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]

    def cache_entry(self, positions: torch.Tensor, x: torch.Tensor, q_rope: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(entries [T, C] = [norm(c) ; rope(k_rope)], rotated q_rope [T, H, Dr])."""
        m = self.mla
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_rope = k_rope.unsqueeze(1)  # [T, 1, Dr]: one rope key shared by every head
        if m.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = self.rotary(positions, q_rope.contiguous(), k_rope.contiguous())
        return torch.cat((self.kv_a_layernorm(latent), k_rope.squeeze(1)), dim=-1), q_rope

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, Dn, Dl], W_UV [H, Dv, Dl]): kv_b_proj's weight per head."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # x: [T, hidden]; positions: [T]
        if self.k_cache is None:
            raise RuntimeError("attention layer used before the KV cache was allocated")
        m, T = self.mla, x.shape[0]
        q_nope, q_rope = self.queries(x)
        entry, q_rope = self.cache_entry(positions, x, q_rope)
        write_latent(entry, self.k_cache, meta.slot_mapping)
        w_uk, w_uv = self.up_weights()
        if meta.max_query_len > 1:  # a prefill chunk or a mixed step
            o = expanded_prefill(q_nope, q_rope, self.k_cache, meta, w_uk, w_uv, m.softmax_scale)  # [T, H, Dv]
            return self.o_proj(o.reshape(T, self.num_heads * m.v_head_dim))
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, Dl]
        q = torch.cat((q_latent, q_rope), dim=-1)  # [T, H, C]
        o = latent_attention(q, self.k_cache, meta, m.softmax_scale, m.kv_lora_rank)  # [T, H, Dl]
        o = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, Dv]
        return self.o_proj(o.reshape(T, self.num_heads * m.v_head_dim))
