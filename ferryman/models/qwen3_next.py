"""Qwen3-Next (`qwen3_next`): a hybrid of gated DeltaNet layers (`linear_attention`, recurrent state
in the state pool) and gated full attention (q_proj yields a per-head output gate; per-head q/k
norms; partial rotary); zero-centred RMSNorm weights (1 + w); softmax top-k routing with a shared
expert behind a sigmoid gate. Qwen3.5 (models/qwen3_5_moe.py) reuses this with its own layout."""

from __future__ import annotations

from typing import Any


from ferryman.config import LinearAttnConfig, ModelConfig
from ferryman.models.base import Target, TensorSpec, hf_common
from ferryman.models.per_expert import PerExpertArchitecture

_LINEAR = "linear_attn."


def layer_types_of(hf: dict[str, Any]) -> tuple[str, ...]:
    """`layer_types`, or every `full_attention_interval`-th layer full attention (the default of 4)."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    interval = hf.get("full_attention_interval", 4)
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(hf["num_hidden_layers"]))


def linear_attn_of(hf: dict[str, Any], fused: bool) -> LinearAttnConfig:
    return LinearAttnConfig(
        num_k_heads=hf["linear_num_key_heads"], num_v_heads=hf["linear_num_value_heads"],
        k_head_dim=hf["linear_key_head_dim"], v_head_dim=hf["linear_value_head_dim"],
        conv_kernel=hf.get("linear_conv_kernel_dim", 4), fused_projections=fused,
    )


class Qwen3Next(PerExpertArchitecture):
    shared_name = "shared_expert"  # and its sigmoid gate, `mlp.shared_expert_gate`
    model_type = "qwen3_next"
    fused_projections = True  # in_proj_qkvz / in_proj_ba

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        L, E = hf["num_hidden_layers"], hf.get("num_experts", 0)
        step = hf.get("decoder_sparse_step", 1) or 1
        mlp_only = set(hf.get("mlp_only_layers") or [])
        return ModelConfig(
            **hf_common(hf, self.quant_methods),
            num_experts=E,
            moe_intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            intermediate_size=hf.get("intermediate_size", 0),
            dense_layers=tuple(i for i in range(L) if i in mlp_only or E == 0 or (i + 1) % step != 0),
            **self.hybrid_fields(hf),
        )

    def hybrid_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The ModelConfig fields Qwen3-Next and Qwen3.5 share."""
        return dict(
            qk_norm="head",
            layer_types=layer_types_of(hf),
            linear_attn=linear_attn_of(hf, self.fused_projections),
            attn_output_gate=True,
            norm_unit_offset=True,
            norm_weight_fp32=True,
            shared_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
            shared_expert_gate=True,
        )

    # ---- checkpoint layout ----------------------------------------------------------------
    def checkpoint_tensors(self, cfg: ModelConfig) -> dict[str, TensorSpec]:
        out = super().checkpoint_tensors(cfg)
        for i in range(cfg.num_layers):
            if cfg.is_linear_layer(i):
                p = f"model.layers.{i}."
                for rel in self.attention_tensors(cfg, cfg.dtype):
                    del out[p + rel]
                out.update({p + _LINEAR + k: v for k, v in self.linear_tensors(cfg).items()})
        return out

    def linear_tensors(self, cfg: ModelConfig) -> dict[str, TensorSpec]:
        """A gated DeltaNet layer's tensors, relative to `linear_attn.`."""
        la, H, dt = cfg.linear_attn, cfg.hidden_size, cfg.dtype
        assert la is not None
        Hv = la.num_v_heads
        out: dict[str, TensorSpec] = {
            "conv1d.weight": ((la.conv_dim, 1, la.conv_kernel), dt),
            "dt_bias": ((Hv,), dt),
            "A_log": ((Hv,), dt),
            "norm.weight": ((la.v_head_dim,), dt),
            "out_proj.weight": ((H, la.value_dim), dt),
        }
        if la.fused_projections:
            out["in_proj_qkvz.weight"] = ((la.conv_dim + la.value_dim, H), dt)
            out["in_proj_ba.weight"] = ((2 * Hv, H), dt)
        else:
            out["in_proj_qkv.weight"] = ((la.conv_dim, H), dt)
            out["in_proj_z.weight"] = ((la.value_dim, H), dt)
            out["in_proj_b.weight"] = ((Hv, H), dt)
            out["in_proj_a.weight"] = ((Hv, H), dt)
        return out

    def map_name(self, cfg: ModelConfig, name: str) -> Target | None:
        prefix, _, rest = name.partition(".linear_attn.")
        if rest and prefix.startswith("model.layers."):
            layer = int(prefix.removeprefix("model.layers."))
            return Target("param", f"layers.{layer}.{_LINEAR}{rest}") if layer < cfg.num_layers else None
        return super().map_name(cfg, name)
