"""Qwen3-MoE (`qwen3_moe`): softmax router with optional renormalisation, per-head q/k RMSNorm."""

from __future__ import annotations

from typing import Any

import torch

from ferryman.config import ModelConfig
from ferryman.models.base import (
    Architecture,
    Target,
    TensorSpec,
    dense_mlp_tensors,
    hf_common,
    map_dense_mlp,
)
from ferryman.models.per_expert import map_per_expert, per_expert_tensors

_NAMES = ("gate_proj", "up_proj", "down_proj")


class Qwen3Moe(Architecture):
    model_type = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        L = hf["num_hidden_layers"]
        E = hf.get("num_experts", hf.get("num_local_experts", 0))
        step = hf.get("decoder_sparse_step", 1) or 1
        mlp_only = set(hf.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(L) if i in mlp_only or E == 0 or (i + 1) % step != 0)
        return ModelConfig(
            **hf_common(hf, self.quant_methods),
            num_experts=E,
            moe_intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            router_kind="softmax_topk",
            router_bias=False,
            expert_act="silu",
            expert_bias=False,
            intermediate_size=hf.get("intermediate_size", 0),
            dense_layers=dense,
            qk_norm="head",
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window") else None,
        )

    def mlp_tensors(self, cfg: ModelConfig, layer: int, dt: torch.dtype) -> dict[str, TensorSpec]:
        if not cfg.is_moe_layer(layer):
            return dense_mlp_tensors(cfg, dt)
        return per_expert_tensors(cfg, dt, "mlp", _NAMES, "gate")

    def map_mlp(self, cfg: ModelConfig, layer: int, rel: str) -> Target | None:
        if not cfg.is_moe_layer(layer):
            return map_dense_mlp(cfg, layer, rel)
        return map_per_expert(cfg, layer, rel, "mlp", _NAMES, "gate")

