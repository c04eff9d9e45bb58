"""Checkpoint layout of the models that store one tensor per expert and projection."""

from __future__ import annotations

import re

import torch

from ferryman.config import ModelConfig
from ferryman.models.base import Architecture, Target, TensorSpec


class PerExpertArchitecture(Architecture):
    """Experts at `{prefix}.experts.{e}.{gate|up|down}.weight`, the router at `{prefix}.gate.weight`
    (and `{prefix}.gate.e_score_correction_bias`, fp32, for sigmoid routing); shared experts at
    `{prefix}.{shared_name}.{gate_proj|up_proj|down_proj}.weight` (and their gate at
    `{prefix}.shared_expert_gate.weight` when the model gates them); a layer without experts holds
    a dense MLP (`mlp.{gate_proj|up_proj|down_proj}.weight`)."""

    prefix = "mlp"
    shared_name = "shared_experts"  # GLM, DeepSeek; Qwen's checkpoints say "shared_expert"
    leaves = ("gate_proj", "up_proj", "down_proj")  # the (gate, up, down) tensor names of an expert

    def mlp_tensors(self, cfg: ModelConfig, layer: int, dt: torch.dtype) -> dict[str, TensorSpec]:
        H = cfg.hidden_size
        if not cfg.is_moe_layer(layer):
            return dense_mlp_tensors("mlp.", H, cfg.intermediate_size, dt)
        I, E = cfg.moe_intermediate_size, cfg.num_experts
        gate, up, down = self.leaves
        out: dict[str, TensorSpec] = {f"{self.prefix}.gate.weight": ((E, H), dt)}
        if cfg.router_kind == "sigmoid":
            out[f"{self.prefix}.gate.e_score_correction_bias"] = ((E,), torch.float32)
        if cfg.shared_intermediate_size:
            out.update(dense_mlp_tensors(f"{self.prefix}.{self.shared_name}.", H, cfg.shared_intermediate_size, dt))
            if cfg.shared_expert_gate:
                out[f"{self.prefix}.shared_expert_gate.weight"] = ((1, H), dt)
        for e in range(E):
            out[f"{self.prefix}.experts.{e}.{gate}.weight"] = ((I, H), dt)
            out[f"{self.prefix}.experts.{e}.{up}.weight"] = ((I, H), dt)
            out[f"{self.prefix}.experts.{e}.{down}.weight"] = ((H, I), dt)
        return out

    def map_mlp(self, cfg: ModelConfig, layer: int, rel: str) -> Target | None:
        p = f"layers.{layer}.mlp."
        if not cfg.is_moe_layer(layer):
            return map_dense_mlp(rel, "mlp.", p, cfg.intermediate_size)
        if rel in (f"{self.prefix}.gate.weight", f"{self.prefix}.gate.e_score_correction_bias",
                   f"{self.prefix}.shared_expert_gate.weight"):
            return Target("param", p + rel.removeprefix(f"{self.prefix}."))
        shared = f"{self.prefix}.{self.shared_name}."
        if cfg.shared_intermediate_size and rel.startswith(shared):
            return map_dense_mlp(rel, shared, p + "shared_experts.", cfg.shared_intermediate_size)
        m = re.match(rf"{re.escape(self.prefix)}\.experts\.(\d+)\.(\w+)\.weight$", rel)
        if not m or m.group(2) not in self.leaves:
            return None
        I = cfg.moe_intermediate_size
        # gate and up fill rows [0, I) and [I, 2I) of the fused w13 bank; down is w2
        rows = ((0, I), (I, 2 * I), None)[self.leaves.index(m.group(2))]
        return Target("expert", "w13" if rows else "w2", layer, int(m.group(1)), rows=rows)


def dense_mlp_tensors(prefix: str, hidden: int, inter: int, dt: torch.dtype) -> dict[str, TensorSpec]:
    """A SwiGLU MLP's checkpoint tensors under `prefix` (a dense layer's, or shared experts')."""
    return {
        prefix + "gate_proj.weight": ((inter, hidden), dt),
        prefix + "up_proj.weight": ((inter, hidden), dt),
        prefix + "down_proj.weight": ((hidden, inter), dt),
    }


def map_dense_mlp(rel: str, prefix: str, param_prefix: str, inter: int) -> Target | None:
    """gate/up fill rows [0, I) / [I, 2I) of `DenseMLP.gate_up_proj`; down is `down_proj`."""
    rows = {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter), "down_proj": None}
    m = re.fullmatch(rf"{re.escape(prefix)}(\w+)\.weight", rel)
    if m is None or m.group(1) not in rows:
        return None
    leaf = m.group(1)
    return Target("param", param_prefix + ("down_proj.weight" if leaf == "down_proj" else "gate_up_proj.weight"),
                  rows=rows[leaf])
