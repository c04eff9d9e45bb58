"""llama.cpp tensor names -> the Hugging Face checkpoint names ferryman's architectures map.

A GGUF tensor `blk.N.attn_q.weight` is the checkpoint's `model.layers.N.self_attn.q_proj.weight`;
the architecture file then places it (models/base.py `map_name`), exactly as for safetensors.
Routed experts (`blk.N.ffn_{gate,up,down}_exps.{weight,bias}`) are not renamed: they go into the
expert banks whole (weights/gguf_load.py).
"""

from __future__ import annotations

import re

import torch

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # gpt-oss
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    **{f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}" for g, h in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                  ("output", "o")) for kind in ("weight", "bias")},
}
# the router, named per architecture in the HF checkpoints
_ROUTER = {"mixtral": "block_sparse_moe.gate", "gpt_oss": "mlp.router"}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")


def hf_name(name: str, model_type: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor, or None (routed experts, tensors ferryman has no use for)."""
    if name in _TOP:
        return _TOP[name]
    m = _BLK.match(name)
    if m is None or EXPERTS.match(name):
        return None
    layer, rel = m.group(1), m.group(2)
    if rel.startswith("ffn_gate_inp."):
        rel_hf = f"{_ROUTER.get(model_type, 'mlp.gate')}.{rel.rsplit('.', 1)[1]}"
    else:
        rel_hf = _LAYER.get(rel)  # type: ignore[assignment]
        if rel_hf is None:
            return None
    return f"model.layers.{layer}.{rel_hf}"


def unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation for llama-arch models (NORM rope: its converter reorders
    each head's rows from the HF halves layout to interleaved pairs). w: [heads * D, ...]."""
    d = w.shape[0] // heads // 2
    return w.reshape(heads, d, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k permutation (HF -> GGUF), the inverse of `unpermute_rope`."""
    d = w.shape[0] // heads // 2
    return w.reshape(heads, 2, d, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
