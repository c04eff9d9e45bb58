"""Parameter counts of a MoE model computed from its HF config alone (no weights, no torch).

`total` counts every tensor of the checkpoint (embedding and lm_head included, biases, norms,
gpt-oss sinks). `active` counts what one token touches: everything except the routed experts,
plus top-k routed experts per MoE layer. Publishers differ on `active`: Mistral and Qwen count
the embedding table (Mixtral 12.9B, Qwen3-30B-A3B 3.3B), OpenAI does not (gpt-oss-20b 3.6B =
our active minus vocab_size * hidden_size).
"""

from __future__ import annotations

from typing import Any, NamedTuple

# Per-architecture extras the generic decoder layer does not have.
_SINKS = {"gpt_oss"}  # one attention-sink logit per query head
_EXPERT_BIAS = {"gpt_oss"}  # gate_up [E, 2I] and down [E, H] biases
_ROUTER_BIAS = {"gpt_oss"}
_QK_NORM = {"qwen3_moe": "per_head", "olmoe": "full_width"}
# Config field of (expert count, routed-expert FFN width), as the transformers class reads it.
_EXPERT_FIELDS = {
    "gpt_oss": ("num_local_experts", "intermediate_size"),
    "mixtral": ("num_local_experts", "intermediate_size"),
    "qwen3_moe": ("num_experts", "moe_intermediate_size"),
    "olmoe": ("num_experts", "intermediate_size"),
}
SUPPORTED_MODEL_TYPES = tuple(_EXPERT_FIELDS)


class ParamCount(NamedTuple):
    total: int
    active: int


class _Dims(NamedTuple):
    hidden: int  # H
    heads: int  # Hq
    kv_heads: int  # Hkv
    head_dim: int  # D
    experts: int  # E
    top_k: int  # K
    expert_inter: int  # I of one routed expert
    dense_inter: int  # I of a dense MLP layer (Qwen3 mlp_only_layers)


def _dims(cfg: dict[str, Any]) -> _Dims:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    experts_field, inter_field = _EXPERT_FIELDS[cfg["model_type"]]
    return _Dims(
        hidden=hidden,
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        experts=cfg[experts_field],
        top_k=cfg["num_experts_per_tok"],
        expert_inter=cfg[inter_field],
        dense_inter=cfg["intermediate_size"],
    )


def _attention_params(cfg: dict[str, Any], d: _Dims) -> int:
    q_width, kv_width = d.heads * d.head_dim, d.kv_heads * d.head_dim
    # q, k, v: [width, H]; o: [H, q_width]
    n = d.hidden * (q_width + 2 * kv_width) + q_width * d.hidden
    if cfg.get("attention_bias", False):
        n += q_width + 2 * kv_width + d.hidden
    if cfg["model_type"] in _SINKS:
        n += d.heads
    qk_norm = _QK_NORM.get(cfg["model_type"])
    if qk_norm == "per_head":
        n += 2 * d.head_dim
    elif qk_norm == "full_width":
        n += q_width + kv_width
    return n


def _one_expert_params(cfg: dict[str, Any], d: _Dims) -> int:
    # gate + up: [2I, H], down: [H, I]
    n = 3 * d.hidden * d.expert_inter
    if cfg["model_type"] in _EXPERT_BIAS:
        n += 2 * d.expert_inter + d.hidden
    return n


def _is_moe_layer(cfg: dict[str, Any], d: _Dims, layer: int) -> bool:
    # Qwen3-MoE keeps dense MLPs on `mlp_only_layers` and off the `decoder_sparse_step` grid.
    if d.experts == 0 or layer in cfg.get("mlp_only_layers", []):
        return False
    return (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0


def _layer_params(cfg: dict[str, Any], d: _Dims, layer: int) -> ParamCount:
    shared = _attention_params(cfg, d) + 2 * d.hidden  # + input and post-attention norms
    if not _is_moe_layer(cfg, d, layer):
        dense = shared + 3 * d.hidden * d.dense_inter
        return ParamCount(dense, dense)
    shared += d.experts * d.hidden + (d.experts if cfg["model_type"] in _ROUTER_BIAS else 0)
    expert = _one_expert_params(cfg, d)
    return ParamCount(shared + d.experts * expert, shared + d.top_k * expert)


def count_params(cfg: dict[str, Any]) -> ParamCount:
    """(total, active) parameter counts of the model `cfg` (an HF config.json dict) describes."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"count_params: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    d = _dims(cfg)
    embed = cfg["vocab_size"] * d.hidden
    head = 0 if cfg.get("tie_word_embeddings", False) else embed
    fixed = embed + head + d.hidden  # + final norm
    layers = [_layer_params(cfg, d, i) for i in range(cfg["num_hidden_layers"])]
    return ParamCount(
        total=fixed + sum(p.total for p in layers),
        active=fixed + sum(p.active for p in layers),
    )
