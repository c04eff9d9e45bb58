"""Mixtral (`mixtral`): softmax router, always renormalised; experts named w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import Any

from ferryman.config import ModelConfig
from ferryman.models.base import hf_common
from ferryman.models.per_expert import PerExpertArchitecture


class Mixtral(PerExpertArchitecture):
    model_type = "mixtral"
    prefix = "block_sparse_moe"
    leaves = ("w1", "w3", "w2")

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        return ModelConfig(
            **hf_common(hf, self.quant_methods),
            num_experts=hf["num_local_experts"],
            moe_intermediate_size=hf["intermediate_size"],
            norm_topk_prob=True,
            sliding_window=hf.get("sliding_window"),
        )
