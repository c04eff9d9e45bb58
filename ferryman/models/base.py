"""What an architecture file provides, and the checkpoint-name plumbing they share.

An architecture (i) turns its HF config dialect into `ModelConfig`, (ii) lists the tensors a
checkpoint must hold (name -> shape, dtype), which drives both validation and dummy weights, and
(iii) maps each checkpoint name to a `Target`: a parameter of `MoETransformer` or a slice of an
expert bank. A new architecture is a new file here, listed in registry.py.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ferryman.config import ModelConfig, RopeConfig
from ferryman.errors import ConfigError
from ferryman.quant.hf_quant import quant_from_hf

Shape = tuple[int, ...]
TensorSpec = tuple[Shape, torch.dtype]


@dataclass(frozen=True)
class Target:
    kind: Literal["param", "expert"]
    name: str  # parameter path in MoETransformer, or expert bank name ("w13", "w2_blocks", ...)
    layer: int = -1
    expert: int | None = None  # per-expert tensor -> that expert; None -> a tensor over all experts
    rows: tuple[int, int] | None = None  # destination row range (dim 0 of a param / of one expert)
    transpose: bool = False  # swap the last two dims before copying


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class Architecture(ABC):
    model_type: str
    # quantisation methods whose tensors this architecture lists itself (the others: quant/hf_quant.py)
    quant_methods: tuple[str, ...] = ()

    @abstractmethod
    def parse_config(self, hf: dict[str, Any]) -> ModelConfig: ...

    @abstractmethod
    def mlp_tensors(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> dict[str, TensorSpec]:
        """Checkpoint tensors of one layer's MLP/MoE block, names relative to the layer."""

    @abstractmethod
    def map_mlp(self, cfg: ModelConfig, layer: int, rel: str) -> Target | None:
        """Target of a layer-relative MLP tensor name, or None if it is not an MLP tensor."""

    # ---- shared by every architecture -------------------------------------------------------
    def checkpoint_tensors(self, cfg: ModelConfig) -> dict[str, TensorSpec]:
        dt = cfg.dtype
        H, V = cfg.hidden_size, cfg.vocab_size
        out: dict[str, TensorSpec] = {"model.embed_tokens.weight": ((V, H), dt), "model.norm.weight": ((H,), dt)}
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = ((V, H), dt)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = ((H,), dt)
            out[p + "post_attention_layernorm.weight"] = ((H,), dt)
            out.update({p + k: v for k, v in self.attention_tensors(cfg, dt).items()})
            out.update({p + k: v for k, v in self.mlp_tensors(cfg, i, dt).items()})
        return out

    def checkpoint_tensors_in(self, cfg: ModelConfig, names: set[str]) -> dict[str, TensorSpec]:
        """The schema of a checkpoint holding `names`: an architecture published in two layouts
        (per-expert or fused expert tensors) picks the one the files hold."""
        return self.checkpoint_tensors(cfg)

    def attention_tensors(self, cfg: ModelConfig, dt: torch.dtype) -> dict[str, TensorSpec]:
        H, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        out: dict[str, TensorSpec] = {}
        q_width = 2 * q if cfg.attn_output_gate else q  # [q | gate] per head
        for proj, width in (("q", q_width), ("k", kv), ("v", kv)):
            out[f"self_attn.{proj}_proj.weight"] = ((width, H), dt)
            if cfg.attention_bias:
                out[f"self_attn.{proj}_proj.bias"] = ((width,), dt)
        out["self_attn.o_proj.weight"] = ((H, q), dt)
        if cfg.attention_out_bias:
            out["self_attn.o_proj.bias"] = ((H,), dt)
        if cfg.qk_norm != "none":  # per head ("head") or over all heads' width ("full")
            full = cfg.qk_norm == "full"
            out["self_attn.q_norm.weight"] = ((q if full else cfg.head_dim,), dt)
            out["self_attn.k_norm.weight"] = ((kv if full else cfg.head_dim,), dt)
        if cfg.attn_sinks:
            out["self_attn.sinks"] = ((cfg.num_heads,), dt)
        return out

    def map_name(self, cfg: ModelConfig, name: str) -> Target | None:
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            return Target("param", name.removeprefix("model."))
        if name == "lm_head.weight":
            return None if cfg.tie_word_embeddings else Target("param", name)
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) >= cfg.num_layers:
            return None
        layer, rel = int(m.group(1)), m.group(2)
        if rel.startswith("self_attn."):
            return self._map_attention(cfg, layer, rel)
        if rel in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return Target("param", f"layers.{layer}.{rel}")
        return self.map_mlp(cfg, layer, rel)

    def _map_attention(self, cfg: ModelConfig, layer: int, rel: str) -> Target | None:
        q, kv = cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1), cfg.num_kv_heads * cfg.head_dim
        rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
        m = re.match(r"self_attn\.([qkv])_proj\.(weight|bias)$", rel)
        if m:
            return Target("param", f"layers.{layer}.self_attn.qkv_proj.{m.group(2)}", rows=rows[m.group(1)])
        return Target("param", f"layers.{layer}.{rel}")


def hf_common(hf: dict[str, Any], quant_methods: tuple[str, ...] = ()) -> dict[str, Any]:
    """ModelConfig fields that every HF decoder config spells the same way."""
    heads = hf["num_attention_heads"]
    return dict(
        model_type=hf["model_type"],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        top_k=hf["num_experts_per_tok"],
        attention_bias=bool(hf.get("attention_bias", False)),
        attention_out_bias=bool(hf.get("attention_bias", False)),
        rope=rope_from_hf(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
        eos_token_ids=eos_ids(hf),
        quant=quant_from_hf(hf, quant_methods),
    )


def rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings from either `rope_parameters` (transformers 5) or `rope_scaling` (4.x)."""
    merged = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(merged.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ("default", "yarn", "linear"):
        raise ConfigError(f"unsupported rope type {kind!r} (supported: default, yarn, linear)")
    max_pos = int(hf.get("max_position_embeddings", 4096))
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(merged.get("factor") or 1.0),
        original_max_position=int(
            merged.get("original_max_position_embeddings")
            or hf.get("original_max_position_embeddings")
            or max_pos
        ),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        truncate=bool(merged.get("truncate", True)),
        attention_factor=merged.get("attention_factor"),
        partial_rotary_factor=float(
            merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        ),
    )


def eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
