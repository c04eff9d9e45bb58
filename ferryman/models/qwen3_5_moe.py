"""Qwen3.5 MoE: `qwen3_5_moe_text` (a text-only checkpoint, `model.layers.*`) and `qwen3_5_moe` (the
published vision-language checkpoints: the text model under `model.language_model.*`, its config
under `text_config`; the vision tower `model.visual.*` is not run). The layers are Qwen3-Next's with
separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a projections, every layer MoE, top-k weights
always renormalised. Text positions are equal on the three M-RoPE axes, so M-RoPE is plain RoPE.
Experts come per expert (`mlp.experts.{e}.gate_proj.weight`, as transformers saves them) or fused
as published (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I])."""

from __future__ import annotations

import logging
import re
from typing import Any

from ferryman.config import ModelConfig
from ferryman.models.base import Target, TensorSpec, hf_common
from ferryman.models.qwen3_next import Qwen3Next

log = logging.getLogger("ferryman.models")
_TEXT = "model.language_model."
_PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")
_FUSED = {"mlp.experts.gate_up_proj": "w13", "mlp.experts.down_proj": "w2"}


class Qwen3_5MoeText(Qwen3Next):
    model_type = "qwen3_5_moe_text"
    fused_projections = False

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        return ModelConfig(
            **hf_common(hf, self.quant_methods),
            num_experts=hf["num_experts"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=True,
            **self.hybrid_fields(hf),
        )

    def checkpoint_tensors_in(self, cfg: ModelConfig, names: set[str]) -> dict[str, TensorSpec]:
        schema = self.checkpoint_tensors(cfg)
        if not any(n.endswith(".mlp.experts.gate_up_proj") for n in names):
            return schema
        out = {n: spec for n, spec in schema.items() if not _PER_EXPERT.search(n)}
        E, I, H, dt = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size, cfg.dtype
        prefix = next(n for n in schema if n.endswith("embed_tokens.weight")).removesuffix("embed_tokens.weight")
        for i in cfg.moe_layers:
            out[f"{prefix}layers.{i}.mlp.experts.gate_up_proj"] = ((E, 2 * I, H), dt)
            out[f"{prefix}layers.{i}.mlp.experts.down_proj"] = ((E, H, I), dt)
        return out

    def map_mlp(self, cfg: ModelConfig, layer: int, rel: str) -> Target | None:
        if rel in _FUSED:  # [E, out, in] like the banks: gate rows then up rows, as w13 holds them
            return Target("expert", _FUSED[rel], layer, None)
        return super().map_mlp(cfg, layer, rel)


class Qwen3_5Moe(Qwen3_5MoeText):
    model_type = "qwen3_5_moe"

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        if "text_config" not in hf:
            raise KeyError("text_config")
        # top-level fields (dtype, tied embeddings, eos) hold unless the text config sets them
        outer = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
        text = {**outer, **hf["text_config"], "model_type": self.model_type}
        if hf.get("vision_config"):
            log.info("qwen3_5_moe: running the text model (model.language_model.*); the vision tower "
                     "(model.visual.*) is not loaded, so image and video inputs are not supported")
        return super().parse_config(text)

    def checkpoint_tensors(self, cfg: ModelConfig) -> dict[str, TensorSpec]:
        return {_TEXT + n.removeprefix("model.") if n.startswith("model.") else n: spec
                for n, spec in super().checkpoint_tensors(cfg).items()}

    def map_name(self, cfg: ModelConfig, name: str) -> Target | None:
        if name.startswith(_TEXT):
            return super().map_name(cfg, "model." + name.removeprefix(_TEXT))
        return None if name.startswith("model.") else super().map_name(cfg, name)
