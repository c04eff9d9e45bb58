"""Write a random-weight GGUF of a model's shapes in a llama.cpp quantisation mix, for benchmarks
(a real 30B checkpoint cannot be converted on a small disk) and loader tests.

    python -m tools.gguf_random --preset qwen3-30b-a3b --mix q4_k_m --out q3-30b-q4km.gguf [--layers N]

--preset: a name of ferryman/assets/presets/*.json, a folder of ferryman/assets (demo-moe), or a
path to a config.json or a model folder (the tiny test models). Architectures: qwen3_moe ->
qwen3moe, gpt_oss -> gpt-oss, mixtral -> llama, olmoe -> olmoe.

Mixes (tensor types as llama.cpp's `llama_tensor_get_type` picks them):
  q4_k_m  LLAMA_FTYPE_MOSTLY_Q4_K_M: experts' gate/up Q4_K, ffn_down Q6_K on the layers
          `use_more_bits` picks and Q4_K elsewhere; attn_v Q6_K on those layers too; with 8 experts
          attn_v and attn_k Q8_0 and attn_output Q5_K; output Q6_K; token_embd and the rest Q4_K
  q4_k    the same with every ffn_down Q4_K (all experts Q4_K)
  mxfp4   LLAMA_FTYPE_MOSTLY_MXFP4_MOE: experts MXFP4, every other matrix Q8_0
A row length that is not a whole number of blocks falls back as llama.cpp does (Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0, then F16). Norms, routers, biases and sinks are F32. With --layers,
the layers keep the types they have in the whole model. Tensors are
generated and written one at a time (memory: the largest tensor), with a progress bar.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from ferryman.quant.gguf_blocks import block_size, random_rows, row_bytes
from tools.gguf_vocab import Vocab, folder_vocab, synthetic_vocab, write_vocab

ASSETS = Path(__file__).resolve().parents[1] / "ferryman" / "assets"
ARCHS = {"qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", "mixtral": "llama", "olmoe": "olmoe"}
MIXES = {"q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M, "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_S,
         "mxfp4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE}
FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "q2_k": "iq4_nl", "q3_k": "iq4_nl", "iq4_xs": "iq4_nl"}


@dataclass(frozen=True)
class Shapes:
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    full_layers: int  # the model's layer count: llama.cpp's per-layer choices follow it
    inter: int  # routed expert FFN size
    dense_inter: int  # FFN size of dense layers (qwen3_moe's mlp_only_layers)
    dense_layers: tuple[int, ...]
    vocab: int
    tied: bool


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order: [..., rows, K]
    gtype: str


def load_config(preset: str) -> tuple[dict, Path | None]:
    """(config dict, the folder holding it when there is one: its tokenizer may come along)."""
    for path in (ASSETS / "presets" / f"{preset}.json", ASSETS / preset / "config.json", Path(preset),
                 Path(preset) / "config.json"):
        if path.is_file():
            return json.loads(path.read_text()), (path.parent if path.name == "config.json" else None)
    raise SystemExit(f"gguf_random: no preset or config {preset!r} (presets: "
                     f"{', '.join(sorted(p.stem for p in (ASSETS / 'presets').glob('*.json')))})")


def shapes_of(cfg: dict, layers: int | None) -> Shapes:
    kind = cfg.get("model_type")
    if kind not in ARCHS:
        raise SystemExit(f"gguf_random: model_type {kind!r} is not one of {sorted(ARCHS)}")
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    n = cfg["num_hidden_layers"] if layers is None else min(layers, cfg["num_hidden_layers"])
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = tuple(i for i in range(n) if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step)
    return Shapes(ARCHS[kind], h, n, nh, cfg.get("num_key_value_heads", nh), cfg.get("head_dim") or h // nh,
                  experts, cfg["num_experts_per_tok"], cfg["num_hidden_layers"], inter,
                  cfg.get("intermediate_size", inter), dense,
                  cfg["vocab_size"], bool(cfg.get("tie_word_embeddings", False)))


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose ffn_down / attn_v get more bits in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def fit(gtype: str, k: int) -> str:
    """llama.cpp's fallback for rows that are not a whole number of blocks."""
    while k % block_size(gtype):
        gtype = FALLBACK.get(gtype, "f16")
    return gtype


def matrix_type(role: str, layer: int, s: Shapes, mix: str) -> str:
    """Type of a 2-D (or expert 3-D) weight by its role, as llama_tensor_get_type for the mix."""
    if mix == "mxfp4":
        return "mxfp4" if role.endswith("_exps") else "q8_0"
    more = use_more_bits(layer, s.full_layers)
    eight = s.experts == 8
    if role == "output":
        return "q6_k"
    if role == "attn_v":
        return "q8_0" if eight else "q6_k" if more else "q4_k"
    if role == "attn_k":
        return "q8_0" if eight else "q4_k"
    if role == "attn_output":
        return "q5_k" if eight else "q4_k"
    if role in ("ffn_down", "ffn_down_exps"):
        return "q6_k" if mix == "q4_k_m" and more else "q4_k"
    return "q4_k"


def plan_tensors(s: Shapes, mix: str) -> list[TensorPlan]:
    h, q_dim, kv_dim = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [TensorPlan("token_embd.weight", (s.vocab, h), fit(matrix_type("token_embd", 0, s, mix), h))]
    for i in range(s.layers):
        def mat(role: str, shape: tuple[int, ...], name: str | None = None) -> None:
            gtype = fit(matrix_type(role, i, s, mix), shape[-1])
            out.append(TensorPlan(f"blk.{i}.{name or role}.weight", shape, gtype))

        def vec(name: str, n: int | tuple[int, ...]) -> None:
            out.append(TensorPlan(f"blk.{i}.{name}", n if isinstance(n, tuple) else (n,), "f32"))

        vec("attn_norm.weight", h)
        mat("attn_q", (q_dim, h))
        mat("attn_k", (kv_dim, h))
        mat("attn_v", (kv_dim, h))
        mat("attn_output", (h, q_dim))
        if s.arch == "qwen3moe":
            vec("attn_q_norm.weight", s.head_dim)
            vec("attn_k_norm.weight", s.head_dim)
        if s.arch == "olmoe":
            vec("attn_q_norm.weight", q_dim)
            vec("attn_k_norm.weight", kv_dim)
        if s.arch == "gpt-oss":
            for name, n in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim), ("attn_output", h)):
                vec(f"{name}.bias", n)
            vec("attn_sinks.weight", s.heads)
        vec("post_attention_norm.weight" if s.arch == "gpt-oss" else "ffn_norm.weight", h)
        if i in s.dense_layers:
            mat("ffn_gate", (s.dense_inter, h))
            mat("ffn_up", (s.dense_inter, h))
            mat("ffn_down", (h, s.dense_inter))
            continue
        out.append(TensorPlan(f"blk.{i}.ffn_gate_inp.weight", (s.experts, h), "f32"))
        if s.arch == "gpt-oss":
            vec("ffn_gate_inp.bias", s.experts)
        mat("ffn_gate_exps", (s.experts, s.inter, h))
        mat("ffn_up_exps", (s.experts, s.inter, h))
        mat("ffn_down_exps", (s.experts, h, s.inter))
        if s.arch == "gpt-oss":
            for name, n in (("ffn_gate_exps", s.inter), ("ffn_up_exps", s.inter), ("ffn_down_exps", h)):
                vec(f"{name}.bias", (s.experts, n))
    out.append(TensorPlan("output_norm.weight", (h,), "f32"))
    if not s.tied:
        out.append(TensorPlan("output.weight", (s.vocab, h), fit(matrix_type("output", 0, s, mix), h)))
    return out


def write_metadata(w: gguf.GGUFWriter, s: Shapes, cfg: dict, mix: str, name: str) -> None:
    """The hyperparameter keys llama.cpp's converter writes for the architecture."""
    a = s.arch
    w.add_name(name)
    w.add_file_type(int(MIXES[mix]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.dense_inter)
    w.add_expert_feed_forward_length(s.inter)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.experts_used)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    w.add_rope_freq_base(float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0))
    if a == "llama":
        w.add_rope_dimension_count(s.head_dim)
        w.add_vocab_size(s.vocab)
    if a == "gpt-oss":
        w.add_sliding_window(cfg.get("sliding_window") or 128)
        if rope.get("rope_type") == "yarn" or rope.get("type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(rope["factor"]))
            w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if a == "llama" and cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])


def random_tensor(t: TensorPlan, gen: torch.Generator) -> np.ndarray:
    """uint8 bytes [..., row_bytes] of valid random data: norms ~1, biases/sinks ~0.1, matrices std 1/sqrt(K)."""
    if t.gtype == "f32" and len(t.shape) == 1 and t.name.endswith("norm.weight"):
        w = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
    elif t.gtype == "f32" and (t.name.endswith(".bias") or "sinks" in t.name):
        w = 0.1 * torch.randn(t.shape, generator=gen)
    else:
        return random_rows(t.gtype, t.shape, gen).numpy()
    return w.float().view(torch.uint8).numpy()


def write_gguf(out: Path, cfg: dict, s: Shapes, mix: str, vocab: Vocab, name: str, seed: int = 0,
               progress: bool = True) -> list[TensorPlan]:
    """Stream a random-weight GGUF to `out`; returns the tensors written."""
    plan = plan_tensors(s, mix)
    w = gguf.GGUFWriter(out, s.arch)
    write_metadata(w, s, cfg, mix, name)
    write_vocab(w, vocab)
    for t in plan:
        qtype = gguf.GGMLQuantizationType[t.gtype.upper()]
        nbytes = row_bytes(t.gtype, t.shape[-1])
        w.add_tensor_info(t.name, (*t.shape[:-1], nbytes), np.dtype(np.uint8), int(np.prod(t.shape[:-1])) * nbytes,
                          raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    gen = torch.Generator().manual_seed(seed)
    total = sum(int(np.prod(t.shape[:-1])) * row_bytes(t.gtype, t.shape[-1]) for t in plan)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task(f"writing {out.name}", total=total)
        for t in plan:
            data = random_tensor(t, gen)
            w.write_tensor_data(data)
            bar.advance(task, data.nbytes)
    w.close()
    return plan


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, help="preset name, ferryman/assets folder, config.json or model folder")
    p.add_argument("--mix", choices=sorted(MIXES), default="q4_k_m")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--layers", type=int, default=None, help="only the first N layers")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers must be at least 1, got {args.layers}")
    cfg, folder = load_config(args.preset)
    s = shapes_of(cfg, args.layers)
    bos, eos = cfg.get("bos_token_id"), cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    vocab = (folder_vocab(folder, s.vocab) if folder else None) or synthetic_vocab(s.vocab, bos, eos)
    name = f"{Path(args.preset).name}-random-{args.mix}"
    plan = write_gguf(args.out, cfg, s, args.mix, vocab, name, args.seed)
    counts: dict[str, int] = {}
    for t in plan:
        counts[t.gtype] = counts.get(t.gtype, 0) + 1
    print(f"wrote {args.out}: {s.arch}, {s.layers} layers, {len(plan)} tensors ({counts}), "
          f"{args.out.stat().st_size / 2**30:.2f} GiB", file=sys.stderr)


if __name__ == "__main__":
    main()
