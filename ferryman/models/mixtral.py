"""Mixtral (`mixtral`): softmax router, always renormalised; experts named w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import Any

import torch

from ferryman.config import ModelConfig
from ferryman.models.base import Architecture, Target, TensorSpec, hf_common
from ferryman.models.per_expert import map_per_expert, per_expert_tensors

_NAMES = ("w1", "w3", "w2")
_PREFIX = "block_sparse_moe"


class Mixtral(Architecture):
    model_type = "mixtral"
    hf_class = "MixtralForCausalLM"

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        return ModelConfig(
            **hf_common(hf, self.quant_methods),
            num_experts=hf["num_local_experts"],
            moe_intermediate_size=hf["intermediate_size"],
            norm_topk_prob=True,
            router_kind="softmax_topk",
            router_bias=False,
            expert_act="silu",
            expert_bias=False,
            sliding_window=hf.get("sliding_window"),
        )

    def mlp_tensors(self, cfg: ModelConfig, layer: int, dt: torch.dtype) -> dict[str, TensorSpec]:
        return per_expert_tensors(cfg, dt, _PREFIX, _NAMES, "gate")

    def map_mlp(self, cfg: ModelConfig, layer: int, rel: str) -> Target | None:
        return map_per_expert(cfg, layer, rel, _PREFIX, _NAMES, "gate")

