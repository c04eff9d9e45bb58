"""The decoder shared by every supported MoE architecture.

Architecture files only translate configs and checkpoint names; the module tree is this one:
embed -> N x (norm, attention, residual, norm, MoE or dense MLP, residual) -> norm -> lm_head.
Routed-expert weights are not part of this tree (see `ferryman.experts`).
"""

from __future__ import annotations

import torch
from torch import nn

from ferryman.config import ModelConfig
from ferryman.layers.attention import Attention
from ferryman.layers.gated_deltanet import GatedDeltaNet
from ferryman.layers.mla import MLAttention
from ferryman.layers.moe import DenseMLP, SparseMoE
from ferryman.layers.norms import RMSNorm
from ferryman.layers.paged_attention import AttnMetadata
from ferryman.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        fp32, offset = cfg.norm_weight_fp32, cfg.norm_unit_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp32, offset)
        # the token mixer: softmax attention (or MLA) over paged KV, or a gated DeltaNet over a state slot
        linear = cfg.is_linear_layer(layer)
        self.self_attn: Attention | MLAttention | None = (
            None if linear else MLAttention(cfg, layer, rotary) if cfg.mla is not None else Attention(cfg, layer, rotary))
        self.linear_attn = GatedDeltaNet(cfg, layer) if linear else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp32, offset)
        self.mlp: nn.Module = (
            SparseMoE(cfg, layer)
            if cfg.is_moe_layer(layer)
            else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttnMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] output of the previous block (not yet added); residual: the stream before it.

        Returns (this block's MLP output, residual stream before it): the add happens fused into the
        next norm, in the same order as the reference (residual + block output, then norm)."""
        h, residual = self.attend(positions, x, residual, meta)
        return self.mlp(h), residual

    def attend(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttnMetadata,
        into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything before the MLP: (MLP input [T, H], residual stream before it), written into
        `into` if given (those may be x's and residual's own rows)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        mixer = self.self_attn if self.self_attn is not None else self.linear_attn
        assert mixer is not None
        h = mixer(positions, h, meta)
        return self.post_attention_layernorm.add_forward(h, residual, into)


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        # one rotary table shared by all layers (it is a buffer, not a parameter)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        # an uninitialised table (the loader fills it): nn.Embedding's own normal_ init, on the meta
        # device the model is built on, imports torch's Python references once per process (~1.2 s)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_fp32, cfg.norm_unit_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor, host_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> [T, H] on input_ids' device. A table kept in host RAM (offloaded plans,
        weights/build.py) gathers its rows on the host, from host_ids (the same ids, already on the
        host) when given, and copies them over in one transfer."""
        table = self.embed_tokens.weight
        if table.device == input_ids.device:
            return self.embed_tokens(input_ids)
        ids = host_ids if host_ids is not None else input_ids.cpu()
        return torch.nn.functional.embedding(ids, table).to(input_ids.device, non_blocking=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                host_ids: torch.Tensor | None = None, embeds: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, H] (final norm applied); host_ids: input_ids on the
        # host (for a host embedding table); embeds: [T, H] already looked up (CUDA graphs' buffer)
        x, residual = (self.embed(input_ids, host_ids) if embeds is None else embeds), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, H] -> logits: [B, V] fp32
        return self.lm_head(hidden).float()

    def moe_blocks(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    def attention_layers(self) -> list[Attention | MLAttention]:
        """The layers that keep KV (a hybrid model's linear-attention layers keep state instead)."""
        return [layer.self_attn for layer in self.layers if layer.self_attn is not None]

    def linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.layers if layer.linear_attn is not None]
