"""Checkpoint layout shared by models that store one tensor per expert and projection."""

from __future__ import annotations

import re

import torch

from ferryman.config import ModelConfig
from ferryman.models.base import Target, TensorSpec


def per_expert_tensors(
    cfg: ModelConfig, dt: torch.dtype, prefix: str, names: tuple[str, str, str], router: str
) -> dict[str, TensorSpec]:
    """names = (gate, up, down) leaf names, e.g. ("gate_proj", "up_proj", "down_proj")."""
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    gate, up, down = names
    out: dict[str, TensorSpec] = {f"{prefix}.{router}.weight": ((E, H), dt)}
    for e in range(E):
        out[f"{prefix}.experts.{e}.{gate}.weight"] = ((I, H), dt)
        out[f"{prefix}.experts.{e}.{up}.weight"] = ((I, H), dt)
        out[f"{prefix}.experts.{e}.{down}.weight"] = ((H, I), dt)
    return out


def map_per_expert(
    cfg: ModelConfig, layer: int, rel: str, prefix: str, names: tuple[str, str, str], router: str
) -> Target | None:
    if rel == f"{prefix}.{router}.weight":
        return Target("param", f"layers.{layer}.mlp.gate.weight")
    m = re.match(rf"{re.escape(prefix)}\.experts\.(\d+)\.(\w+)\.weight$", rel)
    if not m:
        return None
    e, leaf, I = int(m.group(1)), m.group(2), cfg.moe_intermediate_size
    gate, up, down = names
    if leaf == gate:
        return Target("expert", "w13", layer, e, rows=(0, I))
    if leaf == up:
        return Target("expert", "w13", layer, e, rows=(I, 2 * I))
    if leaf == down:
        return Target("expert", "w2", layer, e)
    return None
