"""Qwen3-MoE (`qwen3_moe`): softmax router with optional renormalisation, per-head q/k RMSNorm,
dense MLP layers (`mlp_only_layers`, `decoder_sparse_step`)."""

from __future__ import annotations

from typing import Any

from ferryman.config import ModelConfig
from ferryman.models.base import hf_common
from ferryman.models.per_expert import PerExpertArchitecture


class Qwen3Moe(PerExpertArchitecture):
    model_type = "qwen3_moe"

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
            intermediate_size=hf.get("intermediate_size", 0),
            dense_layers=dense,
            qk_norm="head",
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window") else None,
        )
