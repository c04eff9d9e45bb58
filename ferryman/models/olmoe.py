"""OLMoE (`olmoe`): softmax router without renormalisation, q/k RMSNorm over the full width, clip_qkv."""

from __future__ import annotations

from typing import Any

import torch

from ferryman.config import ModelConfig
from ferryman.models.base import Architecture, Target, TensorSpec, hf_common
from ferryman.models.per_expert import map_per_expert, per_expert_tensors

_NAMES = ("gate_proj", "up_proj", "down_proj")


class Olmoe(Architecture):
    model_type = "olmoe"
    hf_class = "OlmoeForCausalLM"

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        return ModelConfig(
            **hf_common(hf, self.quant_methods),
            num_experts=hf.get("num_experts", hf.get("num_local_experts", 0)),
            moe_intermediate_size=hf["intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            router_kind="softmax_topk",
            router_bias=False,
            expert_act="silu",
            expert_bias=False,
            qk_norm="full",
            clip_qkv=hf.get("clip_qkv"),
        )

    def mlp_tensors(self, cfg: ModelConfig, layer: int, dt: torch.dtype) -> dict[str, TensorSpec]:
        return per_expert_tensors(cfg, dt, "mlp", _NAMES, "gate")

    def map_mlp(self, cfg: ModelConfig, layer: int, rel: str) -> Target | None:
        return map_per_expert(cfg, layer, rel, "mlp", _NAMES, "gate")

