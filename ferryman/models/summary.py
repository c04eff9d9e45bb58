"""Sizes of a model computed from its checkpoint schema: parameters and bytes, experts vs the rest.

The schema (`Architecture.checkpoint_tensors`) is the one list of what a checkpoint holds, so these
counts agree with what the loader reads. MXFP4 blocks hold two weights per byte; their scales
are bytes but not parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferryman.config import ModelConfig
from ferryman.models.registry import get_architecture, model_config


@dataclass(frozen=True)
class ModelSummary:
    cfg: ModelConfig
    total_params: int
    active_params: int  # non-expert + top-k experts per MoE layer (embedding table included)
    expert_params: int
    expert_bytes: int  # all routed experts as stored
    other_bytes: int  # everything else as stored
    bytes_per_expert: int  # one expert of one layer, all its banks


def summarize(hf: dict[str, Any]) -> ModelSummary:
    cfg = model_config(hf)
    arch = get_architecture(cfg.model_type)
    expert_params = other_params = expert_bytes = other_bytes = 0
    for name, (shape, dtype) in arch.checkpoint_tensors(cfg).items():
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        params = 0 if name.endswith("_scales") else numel * (2 if name.endswith("_blocks") else 1)
        target = arch.map_name(cfg, name)
        if target is not None and target.kind == "expert":
            expert_params += params
            expert_bytes += nbytes
        else:
            other_params += params
            other_bytes += nbytes
    num_moe = len(cfg.moe_layers)
    per_expert = expert_bytes // max(1, num_moe * cfg.num_experts)
    active_experts = expert_params * cfg.top_k // cfg.num_experts if cfg.num_experts else 0
    return ModelSummary(
        cfg=cfg,
        total_params=expert_params + other_params,
        active_params=other_params + active_experts,
        expert_params=expert_params,
        expert_bytes=expert_bytes,
        other_bytes=other_bytes,
        bytes_per_expert=per_expert,
    )
