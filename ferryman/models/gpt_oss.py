"""gpt-oss (`gpt_oss`): top-k on biased router logits then softmax over k; attention sinks;
sliding window on the layers marked `sliding_attention`; YaRN; clamped interleaved SwiGLU with
biases; experts fused on disk, MXFP4 (`*_blocks`/`*_scales`) or dense (`gate_up_proj` [E, H, 2I])."""

from __future__ import annotations

from typing import Any

import torch

from ferryman.config import ModelConfig
from ferryman.models.base import Architecture, Target, TensorSpec, hf_common

_P = "mlp.experts."


class GptOss(Architecture):
    model_type = "gpt_oss"
    quant_methods = ("mxfp4",)

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        L = hf["num_hidden_layers"]
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)
        ]
        return ModelConfig(
            **hf_common(hf, self.quant_methods),
            num_experts=hf["num_local_experts"],
            moe_intermediate_size=hf["intermediate_size"],
            norm_topk_prob=False,
            router_kind="topk_softmax",
            router_bias=True,
            expert_act="swiglu_oai",
            expert_bias=True,
            attn_sinks=True,
            sliding_window=hf.get("sliding_window"),
            layer_types=tuple(layer_types),
            norm_weight_fp32=True,
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        )

    def mlp_tensors(self, cfg: ModelConfig, layer: int, dt: torch.dtype) -> dict[str, TensorSpec]:
        H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        out: dict[str, TensorSpec] = {
            "mlp.router.weight": ((E, H), dt),
            "mlp.router.bias": ((E,), dt),
            _P + "gate_up_proj_bias": ((E, 2 * I), dt),
            _P + "down_proj_bias": ((E, H), dt),
        }
        if cfg.expert_format == "mxfp4":
            u8 = torch.uint8
            out[_P + "gate_up_proj_blocks"] = ((E, 2 * I, H // 32, 16), u8)
            out[_P + "gate_up_proj_scales"] = ((E, 2 * I, H // 32), u8)
            out[_P + "down_proj_blocks"] = ((E, H, I // 32, 16), u8)
            out[_P + "down_proj_scales"] = ((E, H, I // 32), u8)
        else:
            out[_P + "gate_up_proj"] = ((E, H, 2 * I), dt)
            out[_P + "down_proj"] = ((E, I, H), dt)
        return out

    def map_mlp(self, cfg: ModelConfig, layer: int, rel: str) -> Target | None:
        if rel.startswith("mlp.router."):
            return Target("param", f"layers.{layer}.mlp.gate.{rel.rsplit('.', 1)[1]}")
        if not rel.startswith(_P):
            return None
        bank = {
            "gate_up_proj_blocks": "w13_blocks",
            "gate_up_proj_scales": "w13_scales",
            "down_proj_blocks": "w2_blocks",
            "down_proj_scales": "w2_scales",
            "gate_up_proj_bias": "w13_bias",
            "down_proj_bias": "w2_bias",
            "gate_up_proj": "w13",
            "down_proj": "w2",
        }.get(rel.removeprefix(_P))
        if bank is None:
            return None
        # dense gpt-oss experts are stored [E, in, out]; banks are [E, out, in]
        return Target("expert", bank, layer, None, transpose=bank in ("w13", "w2"))

