"""Self-attention block: fused QKV projection, optional q/k norms, RoPE, paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from ferryman.config import ModelConfig
from ferryman.layers.norms import RMSNorm
from ferryman.layers.paged_attention import AttnMetadata, paged_attention, write_kv
from ferryman.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """One attention layer. The runner binds `k_cache`/`v_cache` ([N, S, Hkv, D]) before use."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # with an output gate, q_proj yields [q | gate] per head: o * sigmoid(gate) before o_proj
        self.output_gate = cfg.attn_output_gate
        self.q_width = self.q_size * (2 if self.output_gate else 1)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_width + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_out_bias)
        self.qk_norm = cfg.qk_norm  # q/k RMSNorm per head, over all heads ("full"), or none
        norm_sizes = {"head": (cfg.head_dim, cfg.head_dim), "full": (self.q_size, self.kv_size)}
        if cfg.qk_norm in norm_sizes:
            q_size, k_size = norm_sizes[cfg.qk_norm]
            offset = cfg.norm_unit_offset
            self.q_norm = RMSNorm(q_size, cfg.rms_norm_eps, unit_offset=offset)
            self.k_norm = RMSNorm(k_size, cfg.rms_norm_eps, unit_offset=offset)
        self.clip_qkv = cfg.clip_qkv
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attn_sinks else None
        self.window = cfg.window_of(layer)
        self.scale = cfg.head_dim**-0.5
        self.rotary = rotary
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.window_pool = False  # the runner's binding: the caches are the window pool's (kvcache/window_pool.py)

    separate_values = True  # the runner allocates v_cache beside k_cache

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # x: [T, H]; positions: [T]
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_width, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.output_gate:  # q: [T, Hq, 2D] -> q, gate: [T, Hq, D]
            q, gate = q.reshape(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(T, self.num_heads, self.head_dim)  # q: [T, Hq, D]
        k = k.reshape(T, self.num_kv_heads, self.head_dim)  # k: [T, Hkv, D]
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q, k = self.rotary(positions, q, k)
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("attention layer used before the KV cache was allocated")
        if self.window_pool:
            if meta.window_block_tables is None:
                raise RuntimeError("a sliding-window layer with a pool of its own got no window block tables")
            meta = meta.windowed()
        write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        sinks = self.sinks.float() if self.sinks is not None else None
        o = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.window, sinks)
        o = o.reshape(T, self.q_size)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(T, self.q_size))
        return self.o_proj(o)
