"""Presets against transformers' config classes and models, and against published sizes."""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

from ferryman.errors import UnsupportedModelError
from ferryman.models.registry import model_config
from ferryman.models.summary import summarize
from ferryman.planner import non_expert_params
from ferryman.weights.presets import HF_REPO_IDS, PRESETS, get_preset, is_preset

# Sizes the publishers state (model cards / papers). gpt-oss "active" excludes the embedding
# table (OpenAI's convention), GLM's the embedding and lm_head tables; the others include them.
# GLM's totals leave out the MTP layer, which ferryman does not load either.
PUBLISHED = {  # name: (total, active, vocab x hidden tables "active" leaves out)
    "gpt-oss-20b": (20.91e9, 3.61e9, 1),
    "gpt-oss-120b": (116.83e9, 5.13e9, 1),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, 0),
    "mixtral-8x7b": (46.7e9, 12.9e9, 0),
    "olmoe-1b-7b": (6.9e9, 1.3e9, 0),
    "glm-4.5": (355e9, 32e9, 2),
    "glm-4.5-air": (106e9, 12e9, 2),
    "qwen3-235b-a22b": (235e9, 22e9, 0),
    "qwen3-next-80b-a3b": (80e9, 3e9, 1),
    "qwen3.5-397b-a17b": (397e9, 17e9, 0),  # the vision tower (~0.4B) is not in the text preset
    "deepseek-v3": (671e9, 37e9, 0),  # 671B without the 14B MTP module
    "kimi-k2": (1.04e12, 32e9, 0),  # the technical report's 1.04T
}
# Qwen3-Next's card states "3B activated", the rounding of its name (A3B): 3.56B without the
# embedding table, 3.25B without the lm_head too; transformers' own model checks the exact count.
ACTIVE_REL = {"qwen3-next-80b-a3b": 0.2}
# model_types transformers knows under another name (Kimi-K2 runs DeepseekV3ForCausalLM)
HF_MODEL_TYPES = {"kimi_k2": "deepseek_v3"}

# Fields of the published config.json that the transformers 5.x config class does not keep
# under the same name: renamed (rope_* -> rope_parameters, torch_dtype -> dtype) or handled by
# the quantizer; Qwen3-MoE's class has no head_dim default but honours it.
FILE_ONLY = {"rope_theta", "rope_scaling", "torch_dtype", "quantization_config", "head_dim",
             "partial_rotary_factor", "full_attention_interval"}  # the last two: into rope_parameters, layer_types


def _hf_config(cfg: dict):  # noqa: ANN202
    model_type = HF_MODEL_TYPES.get(cfg["model_type"], cfg["model_type"])
    return AutoConfig.for_model(**{**cfg, "model_type": model_type})


def _meta_model(cfg: dict) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_hf_config(cfg))


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_field_is_known_to_transformers(name: str) -> None:
    preset = get_preset(name)
    default = CONFIG_MAPPING[HF_MODEL_TYPES.get(preset["model_type"], preset["model_type"])]()
    unknown = {k for k in preset if not hasattr(default, k)} - FILE_ONLY
    assert not unknown, f"{name}: fields the config class does not know (typos?): {unknown}"
    config = _hf_config(preset)
    for key, value in preset.items():
        if key not in FILE_ONLY | {"model_type"}:
            assert getattr(config, key) == value, key
    assert config.rope_parameters["rope_theta"] == preset["rope_theta"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_counts_matches_transformers_model(name: str) -> None:
    preset = get_preset(name)
    model = _meta_model(preset)
    params = dict(model.named_parameters())
    # a checkpoint tensor that transformers keeps as a buffer: sigmoid routers' correction bias
    total = sum(p.numel() for p in params.values()) + _score_bias_numel(model)
    routed = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    experts = preset.get("num_local_experts") or preset.get("n_routed_experts") or preset["num_experts"]
    top_k = preset["num_experts_per_tok"]
    got = summarize(preset)
    assert got.total_params == total
    assert got.active_params == total - routed * (experts - top_k) // experts


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_counts_matches_published_sizes(name: str) -> None:
    preset = get_preset(name)
    total, active, tables_left_out = PUBLISHED[name]
    got = summarize(preset)
    got_active = got.active_params - tables_left_out * preset["vocab_size"] * preset["hidden_size"]
    assert got.total_params == pytest.approx(total, rel=0.02)
    assert got_active == pytest.approx(active, rel=ACTIVE_REL.get(name, 0.03))


def _score_bias_numel(model: torch.nn.Module) -> int:
    return sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))


_SMALL_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                  topk_group=1)


@pytest.mark.parametrize(
    "base, overrides",
    [
        ("olmoe-1b-7b", {"tie_word_embeddings": True}),
        ("qwen3-30b-a3b", {"mlp_only_layers": [0], "decoder_sparse_step": 2}),
        ("glm-4.5", {"head_dim": 16, "n_group": 4, "topk_group": 2}),  # dense layers 0-2, shared experts
        ("glm-4.5-air", {"head_dim": 16, "n_shared_experts": 2}),
        ("deepseek-v3", {**_SMALL_MLA, "q_lora_rank": 24}),  # MLA with a q LoRA pair, 3 dense layers
        ("kimi-k2", {**_SMALL_MLA, "q_lora_rank": None, "attention_bias": True}),  # one q_proj, biases
    ],
)
def test_param_counts_variants(base: str, overrides: dict) -> None:
    # Tied embeddings and Qwen3's dense layers, on small dims, against transformers.
    cfg = {**get_preset(base), "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 256,
           "intermediate_size": 96, "moe_intermediate_size": 32, "bos_token_id": 1,
           "eos_token_id": 2, "pad_token_id": 3, **overrides}
    if cfg["model_type"] == "qwen3_moe":
        cfg["head_dim"] = 16
    model = _meta_model(cfg)
    params = dict(model.named_parameters())
    assert summarize(cfg).total_params == sum(p.numel() for p in params.values()) + _score_bias_numel(model)
    other = sum(p.numel() for n, p in params.items() if ".mlp.experts." not in n) + _score_bias_numel(model)
    assert non_expert_params(model_config(cfg)) == other  # the planner's count


def test_gpt_oss_layout() -> None:
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        cfg = get_preset(name)
        types = cfg["layer_types"]
        assert len(types) == cfg["num_hidden_layers"]
        assert types[0] == "sliding_attention" and types[1] == "full_attention"
        assert all(t != types[i + 1] for i, t in enumerate(types[:-1]))
        assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 32.0
        assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert get_preset("gpt-oss-120b")["num_local_experts"] == 128


def test_lookup_and_copies() -> None:
    assert is_preset("gpt-oss-20b") and is_preset("Qwen/Qwen3-30B-A3B") and not is_preset("llama")
    for name, repo in HF_REPO_IDS.items():
        assert get_preset(repo) == PRESETS[name]
    cfg = get_preset("mixtral-8x7b")
    cfg["num_hidden_layers"] = 1
    assert PRESETS["mixtral-8x7b"]["num_hidden_layers"] == 32
    with pytest.raises(ValueError, match="gpt-oss-20b.*olmoe-1b-7b"):
        get_preset("gpt-oss-21b")


def test_sizes_of_an_unknown_architecture_are_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="deepseek_v3.*kimi_k2"):
        summarize({"model_type": "llama"})


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "qwen3.5-397b-a17b"])
def test_hybrid_layout(name: str) -> None:
    """Layer kinds, partial rotary and the planner's non-expert count as transformers builds them."""
    preset = get_preset(name)
    config = AutoConfig.for_model(**preset)
    cfg = model_config(preset)
    assert list(cfg.layer_types) == list(config.layer_types)
    assert cfg.rope.partial_rotary_factor == config.rope_parameters["partial_rotary_factor"] == 0.25
    params = dict(_meta_model(preset).named_parameters())
    assert non_expert_params(cfg) == sum(p.numel() for n, p in params.items() if ".mlp.experts." not in n)
