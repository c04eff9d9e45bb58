"""Tiny GGUF models for tests: a tiny Hugging Face checkpoint (tests/tiny_models.py) written as
llama.cpp's converter writes it (tensor names, fused expert tensors, llama's q/k row permutation,
gpt-oss's gate/up split and MXFP4 blocks), each tensor in a chosen ggml type, with gguf-py's
`GGUFWriter` and quantisers.

`write_gguf` also returns the checkpoint as a reader of the file sees it (every tensor
dequantised by gguf-py, back in the HF layout), and `write_reference` saves that as a safetensors
folder: the reference transformers (or ferryman's safetensors path) loads.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, RopeScalingType, dequantize, quantize
from safetensors.torch import load_file, save_file

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe", "gpt_oss": "gpt-oss", "glm4_moe": "glm4moe"}
TypeOf = Callable[[str, tuple[int, ...]], T]
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    **{f"self_attn.{h}_proj.{k}": f"attn_{g}.{k}" for h, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
       for k in ("weight", "bias")},
}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def all_f32(name: str, shape: tuple[int, ...]) -> T:
    return T.F32


def mixed(expert: T, dense: T = T.Q8_0, down: T | None = None) -> TypeOf:
    """`expert` for routed experts (`down` for ffn_down_exps), `dense` for other matrices, F32 for
    vectors (norms, biases: llama.cpp keeps 1-D tensors in F32) and the router."""
    def type_of(name: str, shape: tuple[int, ...]) -> T:
        if len(shape) == 1 or "ffn_gate_inp" in name:
            return T.F32
        if "_exps" in name:
            return down if down is not None and "down" in name else expert
        return dense
    return type_of


def gguf_name(hf: str, arch: str) -> str | None:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf)
    if m is None:
        return None
    rel = m.group(2)
    if rel == "post_attention_layernorm.weight":
        return f"blk.{m.group(1)}.{'post_attention_norm' if arch == 'gpt_oss' else 'ffn_norm'}.weight"
    return f"blk.{m.group(1)}.{_LAYER[rel]}" if rel in _LAYER else None


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order for llama (written independently of ferryman's inverse)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quantised(w: torch.Tensor, qtype: T, name: str = "") -> tuple[np.ndarray, torch.Tensor]:
    """(the bytes to write, the values a reader dequantises from them). Types gguf-py cannot
    quantise (K-quants, IQ4) get valid random blocks of the same shape instead of `w`'s values."""
    data = w.detach().float().numpy()
    try:
        q = data.astype(np.float16) if qtype == T.F16 else data if qtype == T.F32 else quantize(data, qtype)
    except NotImplementedError:
        from ferryman.quant.gguf_blocks import random_rows

        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        q = random_rows(qtype.name.lower(), tuple(w.shape), gen).numpy()
    return q, torch.from_numpy(np.array(dequantize(q, qtype), dtype=np.float32)).reshape(w.shape)


def _experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors -> GGUF's [E, out, in] stacks, named blk.N.ffn_{gate,up,down}_exps.weight."""
    groups: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name in [n for n in tensors if _EXPERT.match(n)]:
        layer, e, proj = _EXPERT.match(name).groups()  # type: ignore[union-attr]
        groups.setdefault((int(layer), _PROJ[proj]), {})[int(e)] = tensors.pop(name)
    return {f"blk.{layer}.ffn_{p}_exps.weight": torch.stack([es[e] for e in sorted(es)])
            for (layer, p), es in groups.items()}


def _ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """HF/ferryman MXFP4 (byte j: elements 2j, 2j+1) -> ggml blocks [scale, 16 bytes: j | j+16 << 4]."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32]
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), qs), dim=-1).flatten(-2).numpy()  # [..., G * 17]


def _gpt_oss_experts(tensors: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                     type_of: TypeOf) -> list[tuple[str, np.ndarray, T]]:
    """gpt-oss's fused, interleaved experts -> ffn_{gate,up}_exps (even / odd rows) and ffn_down_exps,
    MXFP4 kept as is, or dequantised to a float type where `type_of` says (exact: the reference
    keeps the HF tensors)."""
    out: list[tuple[str, np.ndarray, T]] = []

    def add(name: str, data: np.ndarray) -> None:
        qtype = type_of(name, ())
        if qtype in (T.F32, T.F16, T.BF16):
            values = torch.from_numpy(np.array(dequantize(data, T.MXFP4), dtype=np.float32))
            out.append((name, _quantised(values, qtype)[0], qtype))
        else:
            out.append((name, data, T.MXFP4))

    for name in [n for n in tensors if n.endswith("gate_up_proj_blocks")]:
        layer = int(name.split(".")[2])
        p = name.removesuffix("gate_up_proj_blocks")
        blocks, scales, bias = (tensors.pop(p + f"gate_up_proj_{s}") for s in ("blocks", "scales", "bias"))
        for i, proj in enumerate(("gate", "up")):
            add(f"blk.{layer}.ffn_{proj}_exps.weight", _ggml_mxfp4(blocks[:, i::2], scales[:, i::2]))
            out.append((f"blk.{layer}.ffn_{proj}_exps.bias", bias[:, i::2].float().numpy(), T.F32))
        down = [tensors.pop(p + f"down_proj_{s}") for s in ("blocks", "scales", "bias")]
        add(f"blk.{layer}.ffn_down_exps.weight", _ggml_mxfp4(down[0], down[1]))
        out.append((f"blk.{layer}.ffn_down_exps.bias", down[2].float().numpy(), T.F32))
        ref.update({p + f"gate_up_proj_{s}": t for s, t in zip(("blocks", "scales", "bias"), (blocks, scales, bias))})
        ref.update({p + f"down_proj_{s}": t for s, t in zip(("blocks", "scales", "bias"), down)})
    return out


def _metadata(w: GGUFWriter, hf: dict, arch: str, vocab: int) -> None:
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf.get("intermediate_size", 0))
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_layer_norm_rms_eps(hf.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_expert_count(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts"))
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    if arch != "gpt_oss":  # llama.cpp's converter writes no vocab_size for gpt-oss (the token list says it)
        w.add_vocab_size(vocab)
    if arch == "olmoe" and hf.get("clip_qkv"):
        w.add_clamp_kqv(hf["clip_qkv"])
    if arch == "glm4_moe":  # as llama.cpp's Glm4MoeModel writes it
        w.add_rope_dimension_count(int(hf["head_dim"] * hf.get("partial_rotary_factor", 0.5)))
        w.add_expert_shared_count(hf["n_shared_experts"])
        w.add_leading_dense_block_count(hf["first_k_dense_replace"])
        w.add_expert_weights_scale(hf["routed_scaling_factor"])
        w.add_expert_weights_norm(hf["norm_topk_prob"])
        w.add_expert_group_count(hf["n_group"])
        w.add_expert_group_used_count(hf["topk_group"])
    if arch == "gpt_oss":
        rope = hf["rope_parameters"]
        w.add_sliding_window(hf["sliding_window"])
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def write_gguf(folder: Path, arch: str, path: Path, type_of: TypeOf = all_f32, split_tensors: int = 0,
               extra: Callable[[GGUFWriter], None] | None = None) -> dict[str, torch.Tensor]:
    """Write the tiny HF checkpoint in `folder` as a GGUF file at `path` (split every `split_tensors`
    tensors when > 0); `extra` adds metadata or tensors (`byte_tokenizer`). Returns the HF-named
    tensors a reader of the file sees."""
    hf = json.loads((folder / "config.json").read_text())
    tensors = {k: v.float() if v.is_floating_point() else v for f in folder.glob("*.safetensors")
               for k, v in load_file(str(f)).items()}
    w = GGUFWriter(path, GGUF_ARCH[arch], split_max_tensors=split_tensors)
    _metadata(w, hf, arch, tensors["model.embed_tokens.weight"].shape[0])
    if extra is not None:
        extra(w)
    ref: dict[str, torch.Tensor] = {}
    packed = _gpt_oss_experts(tensors, ref, type_of) if arch == "gpt_oss" else []
    stacks = _experts(tensors)
    for name, t in stacks.items():
        data, deq = _quantised(t, type_of(name, tuple(t.shape)), name)
        packed.append((name, data, type_of(name, tuple(t.shape))))
        layer, proj = int(name.split(".")[1]), name.split(".")[2][4:-5]
        leaf = {"mixtral": {"gate": "w1", "up": "w3", "down": "w2"}}.get(arch, {p: p + "_proj" for p in _PROJ.values()})
        prefix = "block_sparse_moe" if arch == "mixtral" else "mlp"
        for e in range(deq.shape[0]):
            ref[f"model.layers.{layer}.{prefix}.experts.{e}.{leaf[proj]}.weight"] = deq[e]
    for hf_name, t in tensors.items():
        name = gguf_name(hf_name, arch)
        assert name is not None, hf_name
        heads = {"q_proj.weight": hf["num_attention_heads"], "k_proj.weight": hf["num_key_value_heads"]}
        perm = next((h for k, h in heads.items() if arch == "mixtral" and hf_name.endswith(k)), None)
        data, deq = _quantised(_permute(t, perm) if perm else t, type_of(name, tuple(t.shape)), name)
        packed.append((name, data, type_of(name, tuple(t.shape))))
        ref[hf_name] = _permute_back(deq, perm) if perm else deq
    for name, data, qtype in packed:
        w.add_tensor(name, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


def _permute_back(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_tokenizer(w: GGUFWriter) -> None:
    """A 256-token byte-level BPE vocabulary (GPT-2's byte alphabet, a few merges), token 10 ('\\n')
    as end of sequence, and a chat template: what llama.cpp's converter writes for a BPE model."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())  # 256 printable stand-ins, in byte order
    merges = ["h e", "l l", "l o"]
    tokens = [t for t in alphabet if t not in ("he", "ll", "lo")][:253] + ["he", "ll", "lo"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(10)
    w.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_reference(folder: Path, arch: str, ref: dict[str, torch.Tensor], out: Path) -> Path:
    """`ref` (write_gguf's answer) as a safetensors folder beside the original config, as llama.cpp
    runs the model: no sliding window for llama-arch (Mixtral) files."""
    out.mkdir(parents=True, exist_ok=True)
    hf = json.loads((folder / "config.json").read_text())
    if arch == "mixtral":
        hf["sliding_window"] = None
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    save_file({k: v.contiguous() for k, v in ref.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out

