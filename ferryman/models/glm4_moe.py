"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (`glm4_moe`): sigmoid routing with a score correction bias
(groups when n_group > 1), shared experts, the first `first_k_dense_replace` layers dense, partial
rotary (rotate-half on the first `partial_rotary_factor` of each head; 0.5 when the config is
silent), per-head q/k RMSNorm when `use_qk_norm`, biases on q/k/v but not o. The MTP layers
(`num_nextn_predict_layers`, stored as layers num_hidden_layers..) are not loaded."""

from __future__ import annotations

import dataclasses
from typing import Any

from ferryman.config import ModelConfig, RopeConfig
from ferryman.models.base import hf_common, rope_from_hf
from ferryman.models.per_expert import PerExpertArchitecture


class Glm4Moe(PerExpertArchitecture):
    model_type = "glm4_moe"

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        L = hf["num_hidden_layers"]
        first_dense = min(int(hf.get("first_k_dense_replace", 1)), L)
        common = hf_common(hf, self.quant_methods)
        common["attention_out_bias"] = False  # o_proj never has a bias
        common["rope"] = glm_rope(hf)
        return ModelConfig(
            **common,
            num_experts=hf["n_routed_experts"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            router_kind="sigmoid",
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            shared_intermediate_size=hf["moe_intermediate_size"] * int(hf.get("n_shared_experts", 1)),
            intermediate_size=hf["intermediate_size"],
            dense_layers=tuple(range(first_dense)),
            qk_norm="head" if hf.get("use_qk_norm") else "none",
            num_mtp_layers=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0),
        )


def glm_rope(hf: dict[str, Any]) -> RopeConfig:
    """RoPE of a GLM config: `partial_rotary_factor` defaults to 0.5 (transformers' Glm4MoeConfig)."""
    rope = rope_from_hf(hf)
    places = (hf, hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {})
    stated = any("partial_rotary_factor" in d for d in places)
    return rope if stated else dataclasses.replace(rope, partial_rotary_factor=0.5)
