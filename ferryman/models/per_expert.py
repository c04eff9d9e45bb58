"""Checkpoint layout of the models that store one tensor per expert and projection."""

from __future__ import annotations

import re

import torch

from ferryman.config import ModelConfig
from ferryman.models.base import Architecture, Target, TensorSpec


class PerExpertArchitecture(Architecture):
    """Experts at `{prefix}.experts.{e}.{gate|up|down}.weight`, the router at `{prefix}.gate.weight`;
    a layer without experts holds a dense MLP (`mlp.{gate_proj|up_proj|down_proj}.weight`)."""

    prefix = "mlp"
    leaves = ("gate_proj", "up_proj", "down_proj")  # the (gate, up, down) tensor names of an expert

    def mlp_tensors(self, cfg: ModelConfig, layer: int, dt: torch.dtype) -> dict[str, TensorSpec]:
        H = cfg.hidden_size
        if not cfg.is_moe_layer(layer):
            I = cfg.intermediate_size
            return {
                "mlp.gate_proj.weight": ((I, H), dt),
                "mlp.up_proj.weight": ((I, H), dt),
                "mlp.down_proj.weight": ((H, I), dt),
            }
        I, E = cfg.moe_intermediate_size, cfg.num_experts
        gate, up, down = self.leaves
        out: dict[str, TensorSpec] = {f"{self.prefix}.gate.weight": ((E, H), dt)}
        for e in range(E):
            out[f"{self.prefix}.experts.{e}.{gate}.weight"] = ((I, H), dt)
            out[f"{self.prefix}.experts.{e}.{up}.weight"] = ((I, H), dt)
            out[f"{self.prefix}.experts.{e}.{down}.weight"] = ((H, I), dt)
        return out

    def map_mlp(self, cfg: ModelConfig, layer: int, rel: str) -> Target | None:
        if not cfg.is_moe_layer(layer):
            I, p = cfg.intermediate_size, f"layers.{layer}.mlp."
            return {
                "mlp.gate_proj.weight": Target("param", p + "gate_up_proj.weight", rows=(0, I)),
                "mlp.up_proj.weight": Target("param", p + "gate_up_proj.weight", rows=(I, 2 * I)),
                "mlp.down_proj.weight": Target("param", p + "down_proj.weight"),
            }.get(rel)
        if rel == f"{self.prefix}.gate.weight":
            return Target("param", f"layers.{layer}.mlp.gate.weight")
        m = re.match(rf"{re.escape(self.prefix)}\.experts\.(\d+)\.(\w+)\.weight$", rel)
        if not m or m.group(2) not in self.leaves:
            return None
        I = cfg.moe_intermediate_size
        # gate and up fill rows [0, I) and [I, 2I) of the fused w13 bank; down is w2
        rows = ((0, I), (I, 2 * I), None)[self.leaves.index(m.group(2))]
        return Target("expert", "w13" if rows else "w2", layer, int(m.group(1)), rows=rows)
