"""GGUF metadata -> the Hugging Face config dict of the same model, then ferryman's `ModelConfig`.

llama.cpp names an architecture (`general.architecture`) and keys its hyper-parameters
`{arch}.block_count`, `{arch}.attention.head_count`, ... (gguf-py's `gguf.constants.Keys`). Each
architecture ferryman runs gets the `config.json` fields its `models/` file reads, so one parser
serves both kinds of checkpoint. What the metadata does not say (llama.cpp hard-codes it per
architecture) is written here with the value llama.cpp uses. The routed experts' format of each
layer comes from the tensor types (`expert_formats`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from ferryman.config import ModelConfig, QuantConfig
from ferryman.errors import ModelLoadError, UnsupportedModelError
from ferryman.models.registry import model_config, read_config_json
from ferryman.quant.base import get_format
from ferryman.weights.gguf_file import GGUFModel

# GGUF architecture -> ferryman model_type ("llama" with experts is Mixtral's layout)
GGUF_ARCHS = {"qwen3moe": "qwen3_moe", "llama": "mixtral", "olmoe": "olmoe", "gpt-oss": "gpt_oss",
              "glm4moe": "glm4_moe"}
FLOAT_TYPES = ("F32", "F16", "BF16")
# token texts llama.cpp also ends generation on, beside the eos / eot / eom ids (llama-vocab.cpp's list)
EOG_TEXTS = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                       "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                       "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                       "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["))


def hf_config(g: GGUFModel) -> dict[str, Any]:
    """The config.json dict of the model in `g` (UnsupportedModelError for other architectures)."""
    if g.arch not in GGUF_ARCHS:
        raise UnsupportedModelError(f"{g.path}: GGUF architecture {g.arch!r} is not one ferryman runs; "
                                    f"supported: {', '.join(GGUF_ARCHS)}")
    if not g.has("blk.0.ffn_gate_exps.weight") and not any(n.endswith("ffn_gate_exps.weight") for n in g.tensors):
        raise UnsupportedModelError(f"{g.path}: a {g.arch} model without routed experts (no ffn_gate_exps "
                                    f"tensors); ferryman runs Mixture-of-Experts models")
    hf = _common(g)
    hf.update(_ARCH_FIELDS[g.arch](g, hf))
    hf.pop("_experts")
    return hf


def _scalar(value: Any) -> Any:
    """Per-layer arrays (some files give head_count_kv per layer) -> their largest value."""
    return max(value) if isinstance(value, list) else value


def _expert_shape(g: GGUFModel) -> tuple[int, int, int]:
    """(E, I, H) of the first layer with routed experts, from its ffn_gate_exps tensor."""
    name = next(n for n in g.tensors if n.endswith("ffn_gate_exps.weight"))
    shape = g.shape(name)
    if len(shape) != 3:
        raise ModelLoadError(f"{g.file_of(name)}: tensor {name!r} has shape {list(shape)}; expected 3 dims "
                             f"[experts, expert FFN, hidden]")
    return shape  # type: ignore[return-value]


def _common(g: GGUFModel) -> dict[str, Any]:
    hidden = int(g.require("{arch}.embedding_length"))
    heads = int(_scalar(g.require("{arch}.attention.head_count")))
    tokens = g.get("tokenizer.ggml.tokens")
    vocab = g.get("{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None and g.has("token_embd.weight"):
        vocab = g.shape("token_embd.weight")[0]
    experts, inter, _ = _expert_shape(g)
    hf: dict[str, Any] = dict(
        vocab_size=int(vocab or 0),
        hidden_size=hidden,
        num_hidden_layers=int(g.require("{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_scalar(g.get("{arch}.attention.head_count_kv", heads))),
        head_dim=int(g.get("{arch}.attention.key_length") or hidden // heads),
        num_experts_per_tok=int(g.require("{arch}.expert_used_count")),
        rope_theta=float(g.get("{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(g.get("{arch}.context_length", 4096)),
        rms_norm_eps=float(g.get("{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings=not g.has("output.weight"),
        torch_dtype="bfloat16",
        attention_bias=g.has("blk.0.attn_q.bias"),
        _experts=(int(g.get("{arch}.expert_count", experts)), inter),
    )
    eos = end_of_generation_ids(g, tokens or [])
    if eos:
        hf["eos_token_id"] = eos
    rope = _rope_scaling(g)
    if rope:
        hf["rope_scaling"] = rope
    return hf


def end_of_generation_ids(g: GGUFModel, tokens: list[str]) -> list[int]:
    """The ids llama.cpp stops on: end of sequence, end of turn, end of message, and every token whose
    text is one of EOG_TEXTS; harmony vocabularies (gpt-oss: <|return|> and <|call|>) drop <|end|>,
    which ends a message there, not the answer. The folder of the same model lists the same ids in
    generation_config.json (gpt-oss: <|return|>, <|endoftext|>, <|call|>)."""
    ids = [int(i) for k in ("eos", "eot", "eom") if (i := g.get(f"tokenizer.ggml.{k}_token_id")) is not None]
    by_text = {t: i for i, t in enumerate(tokens) if t in EOG_TEXTS}
    if "<|return|>" in by_text and ("<|call|>" in by_text or "<|calls|>" in by_text) or \
            "<|calls|>" in by_text and "<|flush|>" in by_text:
        end = by_text.pop("<|end|>", None)
        ids = [i for i in ids if i != end]
    return list(dict.fromkeys(ids + sorted(by_text.values())))


def _rope_scaling(g: GGUFModel) -> dict[str, Any] | None:
    kind = g.get("{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    out: dict[str, Any] = {"rope_type": kind, "factor": float(g.get("{arch}.rope.scaling.factor", 1.0))}
    original = g.get("{arch}.rope.scaling.original_context_length")
    if original:
        out["original_max_position_embeddings"] = int(original)
    return out


def _moe_layers(g: GGUFModel, layers: int) -> list[int]:
    return [i for i in range(layers) if g.has(f"blk.{i}.ffn_gate_inp.weight")]


def _qwen3moe(g: GGUFModel, hf: dict[str, Any]) -> dict[str, Any]:
    L = hf["num_hidden_layers"]
    moe = set(_moe_layers(g, L))
    # llama.cpp renormalises qwen3moe's top-k weights (norm_w = true)
    return dict(model_type="qwen3_moe", num_experts=hf["_experts"][0], moe_intermediate_size=hf["_experts"][1],
                intermediate_size=int(g.get("{arch}.feed_forward_length", 0)), norm_topk_prob=True,
                mlp_only_layers=[i for i in range(L) if i not in moe])


def _llama(g: GGUFModel, hf: dict[str, Any]) -> dict[str, Any]:
    # Mixtral-style: every layer MoE, top-k renormalised (llama.cpp: norm_w = true)
    return dict(model_type="mixtral", num_local_experts=hf["_experts"][0], intermediate_size=hf["_experts"][1])


def _olmoe(g: GGUFModel, hf: dict[str, Any]) -> dict[str, Any]:
    # OLMoE: top-k weights not renormalised (llama.cpp: norm_w = false); qkv clipped
    return dict(model_type="olmoe", num_experts=hf["_experts"][0], intermediate_size=hf["_experts"][1],
                norm_topk_prob=False, clip_qkv=g.get("{arch}.attention.clamp_kqv"))


def _gpt_oss(g: GGUFModel, hf: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = dict(model_type="gpt_oss", num_local_experts=hf["_experts"][0],
                               intermediate_size=hf["_experts"][1],
                               sliding_window=g.get("{arch}.attention.sliding_window"))
    rope = hf.get("rope_scaling")
    if rope and rope["rope_type"] == "yarn":  # betas as the converter writes them (else the published
        # configs' 32 / 1), not truncated as the published configs say
        out["rope_scaling"] = {**rope, "beta_fast": float(g.get("{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                               "beta_slow": float(g.get("{arch}.rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    return out


def _glm4moe(g: GGUFModel, hf: dict[str, Any]) -> dict[str, Any]:
    # sigmoid routing with a correction bias (exp_probs_b), shared experts, leading dense layers,
    # partial rotary; the last nextn_predict_layers blocks are multi-token prediction (not loaded)
    nextn = int(g.get("{arch}.nextn_predict_layers", 0))
    rope_dim = g.get("{arch}.rope.dimension_count")
    return dict(model_type="glm4_moe", num_hidden_layers=hf["num_hidden_layers"] - nextn,
                num_nextn_predict_layers=nextn, n_routed_experts=hf["_experts"][0],
                moe_intermediate_size=hf["_experts"][1], intermediate_size=int(g.get("{arch}.feed_forward_length", 0)),
                n_shared_experts=int(g.get("{arch}.expert_shared_count", 1)),
                first_k_dense_replace=int(g.get("{arch}.leading_dense_block_count", 1)),
                routed_scaling_factor=float(g.get("{arch}.expert_weights_scale", 1.0)),
                norm_topk_prob=bool(g.get("{arch}.expert_weights_norm", True)),
                n_group=int(g.get("{arch}.expert_group_count", 1) or 1),
                topk_group=int(g.get("{arch}.expert_group_used_count", 1) or 1),
                use_qk_norm=g.has("blk.0.attn_q_norm.weight"),
                partial_rotary_factor=int(rope_dim) / hf["head_dim"] if rope_dim else 0.5)


_ARCH_FIELDS = {"qwen3moe": _qwen3moe, "llama": _llama, "olmoe": _olmoe, "gpt-oss": _gpt_oss, "glm4moe": _glm4moe}


def expert_format_of(g: GGUFModel, layer: int) -> str:
    """The ExpertFormat name of one layer's routed experts, from its tensor types: float experts
    dequantised to `dense`, MXFP4 repacked into `mxfp4`, block types kept as `gguf:<w13>:<w2>`."""
    names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    missing = [n for n in names if not g.has(n)]
    if missing:
        raise ModelLoadError(f"{g.path}: layer {layer} has a router but no tensor {missing[0]!r}")
    gate, up, down = (g.type_name(n) for n in names)
    if gate != up:
        raise ModelLoadError(f"{g.file_of(names[0])}: layer {layer}'s ffn_gate_exps is {gate} but ffn_up_exps is "
                             f"{up}; ferryman keeps gate and up in one bank and needs them of one type")
    if gate in FLOAT_TYPES and down in FLOAT_TYPES:
        return "dense"
    if gate == down == "MXFP4":
        return "mxfp4"
    name = f"gguf:{gate.lower()}:{down.lower()}"
    try:
        get_format(name)
    except ValueError as e:
        raise UnsupportedModelError(f"{g.file_of(names[0])}: layer {layer}'s routed experts are {gate} (gate, up) and "
                                    f"{down} (down), which ferryman cannot keep packed: {e}") from None
    return name


def gguf_model_config(g: GGUFModel, config_folder: str | Path | None = None) -> ModelConfig:
    """The ModelConfig of `g`: from its metadata, or from `config_folder`'s config.json when given;
    the expert formats (per layer when the file mixes types) always from its tensors."""
    g.check_types()
    if config_folder is not None:
        hf = read_config_json(config_folder)
        hf.pop("quantization_config", None)  # the experts' format is the file's
    else:
        hf = hf_config(g)
    cfg = model_config(hf)
    formats = {layer: expert_format_of(g, layer) for layer in cfg.moe_layers}
    common = Counter(formats.values()).most_common(1)[0][0] if formats else "dense"
    per_layer = tuple(formats.get(i, "") for i in range(cfg.num_layers))
    return replace(cfg, quant=None if common == "dense" else QuantConfig(common),
                   expert_formats=per_layer if len(set(formats.values())) > 1 else ())
