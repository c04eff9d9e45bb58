"""OLMoE (`olmoe`): softmax router without renormalisation, q/k RMSNorm over the full width, clip_qkv."""

from __future__ import annotations

from typing import Any

from ferryman.config import ModelConfig
from ferryman.models.base import hf_common
from ferryman.models.per_expert import PerExpertArchitecture


class Olmoe(PerExpertArchitecture):
    model_type = "olmoe"

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        return ModelConfig(
            **hf_common(hf, self.quant_methods),
            num_experts=hf.get("num_experts", hf.get("num_local_experts", 0)),
            moe_intermediate_size=hf["intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            qk_norm="full",
            clip_qkv=hf.get("clip_qkv"),
        )
