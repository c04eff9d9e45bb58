"""Built-in model presets for `load_format="dummy"`: real Hugging Face configs, no weights.

Each preset holds the fields of the model's published `config.json` that shape tensors or change
the math, as the file spells them, so a dummy run allocates exactly the tensors the real checkpoint
has.
"""

from __future__ import annotations

import copy
from typing import Any


def _gpt_oss(num_layers: int, num_experts: int) -> dict[str, Any]:
    # openai/gpt-oss-20b and -120b differ only in depth and expert count.
    # The published file has no torch_dtype: non-expert tensors are bf16, experts MXFP4.
    return {
        "attention_bias": True,
        "eos_token_id": 200002,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        # even layers use the 128-token sliding window, odd layers full attention
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": 8,
        "num_local_experts": num_experts,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "vocab_size": 201088,
    }


_QWEN3_30B_A3B: dict[str, Any] = {  # Qwen/Qwen3-30B-A3B
    "attention_bias": False,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}

_MIXTRAL_8X7B: dict[str, Any] = {  # mistralai/Mixtral-8x7B-v0.1 (head_dim = 4096 / 32)
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}

_OLMOE_1B_7B: dict[str, Any] = {  # allenai/OLMoE-1B-7B-0924 (head_dim = 2048 / 16)
    "attention_bias": False,
    "clip_qkv": None,
    "eos_token_id": 50279,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "max_position_embeddings": 4096,
    "model_type": "olmoe",
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "pad_token_id": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 50304,
}

PRESETS: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": _gpt_oss(num_layers=24, num_experts=32),
    "gpt-oss-120b": _gpt_oss(num_layers=36, num_experts=128),
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "mixtral-8x7b": _MIXTRAL_8X7B,
    "olmoe-1b-7b": _OLMOE_1B_7B,
}

# Hugging Face repo id of each preset; `get_preset` accepts either spelling.
HF_REPO_IDS: dict[str, str] = {
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "gpt-oss-120b": "openai/gpt-oss-120b",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "olmoe-1b-7b": "allenai/OLMoE-1B-7B-0924",
}

_ALIASES: dict[str, str] = {
    **{name: name for name in PRESETS},
    **{repo.lower(): name for name, repo in HF_REPO_IDS.items()},
}


def _resolve(name: str) -> str | None:
    """Preset key for a preset name or HF repo id (case-insensitive), None if unknown."""
    return _ALIASES.get(name.strip().lower()) if isinstance(name, str) else None


def is_preset(name: str) -> bool:
    return _resolve(name) is not None


def get_preset(name: str) -> dict[str, Any]:
    """A fresh copy of the preset's config dict (callers may mutate it)."""
    key = _resolve(name)
    if key is None:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[key])
