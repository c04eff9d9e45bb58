"""DeepSeek-V3 (`deepseek_v3`) and Kimi-K2 (`kimi_k2`, the same architecture): multi-head latent
attention (layers/mla.py) with interleaved rope and yarn's mscale in the softmax scale; the MoE
layers are DeepSeek's (sigmoid routing with a correction bias, group-limited top-k, a routed
scaling factor, shared experts), after `first_k_dense_replace` dense layers."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

import torch

from ferryman.config import MLAConfig, ModelConfig, RopeConfig
from ferryman.errors import ConfigError
from ferryman.models.base import Target, TensorSpec, hf_common
from ferryman.models.per_expert import PerExpertArchitecture

_MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's yarn magnitude correction: 0.1 * mscale * ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope settings as transformers merges them (rope_scaling of 4.x, rope_parameters of 5)."""
    return {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}


def mla_rope(hf: dict[str, Any], rope: RopeConfig) -> RopeConfig:
    """Yarn's factor defaults to max_position / original_max_position; with both `mscale` and
    `mscale_all_dim` the cos/sin scale is their mscale ratio (transformers' _compute_yarn_parameters)."""
    if rope.kind != "yarn":
        return rope
    p = rope_params(hf)
    factor = p.get("factor") or hf.get("max_position_embeddings", 4096) / rope.original_max_position
    attention_factor = rope.attention_factor
    if attention_factor is None and p.get("mscale") and p.get("mscale_all_dim"):
        attention_factor = yarn_mscale(factor, p["mscale"]) / yarn_mscale(factor, p["mscale_all_dim"])
    return replace(rope, factor=float(factor), attention_factor=attention_factor)


def mla_config(hf: dict[str, Any]) -> MLAConfig:
    missing = [f for f in _MLA_FIELDS if not hf.get(f)]
    if missing:
        raise ConfigError(f"config.json of a {hf.get('model_type')} model lacks {', '.join(missing)} "
                          "(multi-head latent attention needs each, > 0)")
    qk_head_dim = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    scale = qk_head_dim**-0.5
    p = rope_params(hf)
    kind = p.get("rope_type", p.get("type", "default"))
    if kind != "default" and p.get("mscale_all_dim"):
        mscale = yarn_mscale(float(p.get("factor") or 1.0), p["mscale_all_dim"])
        scale *= mscale * mscale
    return MLAConfig(
        q_lora_rank=hf.get("q_lora_rank") or None,
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_interleave=bool(hf.get("rope_interleave", True)),
        softmax_scale=scale,
    )


def mla_common(hf: dict[str, Any], quant_methods: tuple[str, ...]) -> dict[str, Any]:
    """hf_common with MLA's view: head_dim is the rope part (the rotary table's width), and every
    query head reads the one latent "kv head"."""
    common = hf_common(hf, quant_methods)
    mla = mla_config(hf)
    common.update(head_dim=mla.qk_rope_head_dim, num_kv_heads=common["num_heads"], mla=mla,
                  rope=mla_rope(hf, common["rope"]))
    return common


class DeepseekV3(PerExpertArchitecture):
    model_type = "deepseek_v3"

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        L = hf["num_hidden_layers"]
        first_dense = hf.get("first_k_dense_replace") or 0
        return ModelConfig(
            **mla_common(hf, self.quant_methods),
            num_experts=hf["n_routed_experts"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            router_kind="sigmoid",
            n_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            shared_intermediate_size=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
            intermediate_size=hf["intermediate_size"],
            dense_layers=tuple(range(min(first_dense, L))),
            num_mtp_layers=hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0,
        )

    def attention_tensors(self, cfg: ModelConfig, dt: torch.dtype) -> dict[str, TensorSpec]:
        m, H, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
        assert m is not None
        p = "self_attn."
        out: dict[str, TensorSpec] = {}
        if m.q_lora_rank is None:
            out[p + "q_proj.weight"] = ((heads * m.qk_head_dim, H), dt)
        else:
            out[p + "q_a_proj.weight"] = ((m.q_lora_rank, H), dt)
            out[p + "q_a_layernorm.weight"] = ((m.q_lora_rank,), dt)
            out[p + "q_b_proj.weight"] = ((heads * m.qk_head_dim, m.q_lora_rank), dt)
        out[p + "kv_a_proj_with_mqa.weight"] = ((m.cache_dim, H), dt)
        out[p + "kv_a_layernorm.weight"] = ((m.kv_lora_rank,), dt)
        out[p + "kv_b_proj.weight"] = ((heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), dt)
        out[p + "o_proj.weight"] = ((H, heads * m.v_head_dim), dt)
        if cfg.attention_bias:
            if m.q_lora_rank is not None:
                out[p + "q_a_proj.bias"] = ((m.q_lora_rank,), dt)
            out[p + "kv_a_proj_with_mqa.bias"] = ((m.cache_dim,), dt)
            out[p + "o_proj.bias"] = ((H,), dt)
        return out

    def _map_attention(self, cfg: ModelConfig, layer: int, rel: str) -> Target | None:
        # every MLA tensor is a parameter of the same name (no fused qkv)
        if not re.match(r"self_attn\.\w+\.(weight|bias)$", rel):
            return None
        return Target("param", f"layers.{layer}.{rel}")


class KimiK2(DeepseekV3):
    """Kimi-K2's config.json says `kimi_k2` for DeepseekV3ForCausalLM."""

    model_type = "kimi_k2"
