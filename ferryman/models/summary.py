"""Sizes of a model computed from its checkpoint schema: parameters and bytes, experts vs the rest.

The schema (`Architecture.checkpoint_tensors`) is the one list of what a checkpoint holds, so these
counts agree with what the loader reads. MXFP4 blocks hold two weights per byte; their scales
are bytes but not parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ferryman.config import ModelConfig
from ferryman.models.registry import get_architecture, model_config
from ferryman.quant.base import get_format
from ferryman.quant.hf_quant import is_ignored
from ferryman.quant.linear_layouts import is_linear_weight, linear_layout


@dataclass(frozen=True)
class ModelSummary:
    cfg: ModelConfig
    total_params: int
    active_params: int  # non-expert + top-k experts per MoE layer (embedding table included)
    expert_bytes: int  # all routed experts as stored
    other_bytes: int  # everything else as stored
    bytes_per_expert: int  # one expert of one layer, all its banks


def summarize(hf: dict[str, Any] | ModelConfig) -> ModelSummary:
    """Sizes of the model of a config.json dict, or of a ModelConfig (a GGUF file's)."""
    cfg = hf if isinstance(hf, ModelConfig) else model_config(hf)
    arch = get_architecture(cfg.model_type)
    params, nbytes = {True: 0, False: 0}, {True: 0, False: 0}  # keyed by "is a routed expert"
    int_ckpt = cfg.quant is not None and cfg.quant.linear.startswith("int:")  # packed by weights/int_source.py
    layout = linear_layout(cfg.quant.linear) if cfg.quant is not None and cfg.quant.linear and not int_ckpt else None
    for name, (shape, dtype) in arch.checkpoint_tensors(cfg).items():
        numel = math.prod(shape)
        target = arch.map_name(cfg, name)
        expert = target is not None and target.kind == "expert"
        params[expert] += 0 if name.endswith("_scales") else numel * (2 if name.endswith("_blocks") else 1)
        quantised = layout is not None and is_linear_weight(name, shape) and not is_ignored(
            name.removesuffix(".weight"), cfg.quant.ignore if cfg.quant else ())
        # a quantised Linear: its parts as stored (routed experts stay so; other layers are dequantised at load)
        nbytes[expert] += (sum(math.prod(s) * d.itemsize for s, d in layout.parts(*shape).values())
                           if quantised and layout is not None else numel * dtype.itemsize)
    if int_ckpt:  # routed experts as their int banks hold them
        per_expert = get_format(cfg.expert_format).expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size,
                                                                cfg.expert_bias, cfg.dtype)
        nbytes[True] = per_expert * len(cfg.moe_layers) * cfg.num_experts
    active_experts = params[True] * cfg.top_k // cfg.num_experts if cfg.num_experts else 0
    if cfg.expert_formats or cfg.expert_format.startswith("gguf:"):  # packed blocks the schema does not list
        nbytes[True] = sum(cfg.num_experts * get_format(cfg.expert_format_of(i)).expert_bytes(
            cfg.hidden_size, cfg.moe_intermediate_size, cfg.expert_bias, cfg.dtype) for i in cfg.moe_layers)
    return ModelSummary(
        cfg=cfg,
        total_params=params[True] + params[False],
        active_params=params[False] + active_experts,
        expert_bytes=nbytes[True],
        other_bytes=nbytes[False],
        bytes_per_expert=nbytes[True] // max(1, len(cfg.moe_layers) * cfg.num_experts),
    )
