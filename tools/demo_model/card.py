"""Loss-curve image and model card (README.md), both generated from the run's logs."""

from __future__ import annotations

import math
from pathlib import Path

from tools.demo_model.config import BuildSpec

LOSS_CURVE_FILE = "loss_curve.png"
ROUTING_TODO = "TODO(routing-stats): filled in by a later step from measured routing; no numbers yet."


def put_card_section(card: Path, mark: str, body: str, before: tuple[str, ...] = ()) -> None:
    """Write `mark`, a blank line and `body` into the model card in place of what follows `mark` up to
    the next "## " heading; a card without `mark` gets the section just before the first heading of
    `before` that it holds (ValueError when it holds none)."""
    text = card.read_text(encoding="utf-8")
    section = f"{mark}\n\n{body.rstrip(chr(10))}\n"
    if mark in text:
        head, rest = text.split(mark, 1)
        tail = "\n## " + rest.split("\n## ", 1)[1] if "\n## " in rest else ""
    else:
        anchor = next((h for h in before if h in text), None)
        if anchor is None:
            raise ValueError(f"{card}: no {mark!r} and none of the headings {before}")
        head, rest = text.split(anchor, 1)
        tail = "\n" + anchor + rest
    card.write_text(head + section + tail, encoding="utf-8")


def plot_loss_curve(rows: list[dict], val_rows: list[dict], heldout: float, path: Path) -> bool:
    """Training and validation loss against tokens seen, final held-out loss as a dashed line.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    ax.plot([r["tokens"] / 1e6 for r in rows], [r["loss"] for r in rows], label="training loss")
    ax.plot([r["tokens"] / 1e6 for r in val_rows], [r["val_loss"] for r in val_rows], marker=".",
            label="validation loss")
    ax.axhline(heldout, color="tab:red", linestyle="--", label=f"held-out loss {heldout:.3f}")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("ferryman demo MoE: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _parameter_counts(model: dict, total: int) -> tuple[int, int]:
    """(total, active per token): a token uses top_k of the num_experts experts in each layer."""
    per_expert = 3 * model["hidden_size"] * model["moe_intermediate_size"]
    idle = model["num_layers"] * (model["num_experts"] - model["top_k"]) * per_expert
    return total, total - idle


def _context(m: dict) -> str:
    """The served context: YaRN over the positions the model was built for (ModelSpec.served_rope)."""
    factor, built = m.get("yarn_factor", 1), m["max_position_embeddings"]
    if factor == 1:
        return f"{built} positions"
    return (f"{int(built * factor)} positions: RoPE scaled by YaRN (factor {factor:g} over the {built} it was "
            "built for; `rope_parameters` in `config.json`)")


def _model_section(spec: dict, params: int, weights_bytes: int) -> list[str]:
    m = spec["model"]
    total, active = _parameter_counts(m, params)
    return [
        "## Model", "",
        "| | |", "| --- | --- |",
        "| architecture | `qwen3_moe` (`Qwen3MoeForCausalLM`), every layer MoE, no shared expert |",
        f"| layers / hidden | {m['num_layers']} / {m['hidden_size']} |",
        f"| attention | {m['num_heads']} query heads, {m['num_kv_heads']} KV heads, head_dim {m['head_dim']}, "
        f"q/k RMSNorm, RoPE theta {m['rope_theta']:g} |",
        f"| experts | {m['num_experts']} routed experts per layer, top-{m['top_k']}, softmax then renormalised "
        f"(`norm_topk_prob`), expert width {m['moe_intermediate_size']}, SiLU-gated |",
        f"| vocabulary / context | {m['vocab_size']} byte-level BPE tokens / {_context(m)} |",
        f"| parameters | {total / 1e6:.2f} M total, {active / 1e6:.2f} M active per token "
        "(embedding tied with the output head) |",
        f"| weights | `model.safetensors`, bf16, {weights_bytes / 2**20:.2f} MiB |",
        "",
    ]


def _data_section(stats: dict) -> list[str]:
    files, tokens, size = stats["files"], stats["tokens"], stats["bytes"]
    tests = "kept (they are Python code too)" if stats["include_tests"] else "excluded"
    if not stats["has_test_package"]:
        tests += "; this installation has no `test` package (some distributions ship it separately)"
    return [
        "## Data", "",
        f"Every `.py` file of the standard library of {stats['python_implementation']} "
        f"{stats['python_version']} (`sysconfig.get_paths()['stdlib']`, site-packages excluded). "
        f"Test directories: {tests}; {files['train_test_dirs']} of the training files are tests.",
        "",
        "| | files | bytes | tokens |", "| --- | --- | --- | --- |",
        *(f"| {label} | {files[k]:,} | {size[k]:,} | {tokens[k]:,} |"
          for k, label in (("train", "training"), ("val", "validation"), ("heldout", "held out"))),
        "",
        f"{files['found']:,} files found, {files['duplicates']:,} exact duplicates dropped, "
        f"{files['undecodable']:,} undecodable files skipped. Split by relative path: "
        f"`{stats['split_rule']}`. Token counts include one `<|endoftext|>` after each file. "
        "The list of held-out files is in `corpus_stats.json`.",
        "",
        "Licence of the data: the CPython standard library is Copyright (c) Python Software Foundation "
        "and distributed under the Python Software Foundation License (PSF-2.0).",
        "",
    ]


def _training_section(spec: dict, train: dict) -> list[str]:
    t = spec["train"]
    rate = train["tokens"] / max(train["seconds"], 1e-9)
    return [
        "## Training", "",
        f"Plain PyTorch loop (`tools/demo_model/train.py`) on {train['device']}: AdamW "
        f"(betas {tuple(t['betas'])}, weight decay {t['weight_decay']}, clip {t['grad_clip']}), "
        f"peak learning rate {t['lr']:g}, {t['warmup_steps']} warm-up steps, cosine decay to "
        f"{t['min_lr_ratio']:g}x over a {t['minutes']:g}-minute budget, batch {t['batch_size']} x "
        f"{t['seq_len']} tokens (files packed, separated by `<|endoftext|>`), "
        f"{'bf16 autocast' if train['device_type'] == 'cuda' else 'fp32'}, router load-balancing "
        f"loss x {spec['model']['router_aux_loss_coef']:g}, seed {t['seed']}.",
        "",
        f"Ran {train['steps']:,} steps, {train['tokens']:,} tokens ({train['epochs']:.2f} epochs) in "
        f"{train['seconds']:.0f} s ({rate:,.0f} tokens/s), stopped by {train['stopped_by']}; "
        f"final training loss {train['final_loss']:.4f}. torch {train['torch']}, transformers {train['transformers']}.",
        "",
        f"Validation loss was measured every {t['val_every']} steps on {t['max_val_windows']} windows at most; "
        f"the exported weights are those of step {train['best_step']:,} (lowest validation loss, "
        f"{train['best_val_loss']:.4f}){' rather than the last step' if train['restored_best'] else ', the last one'}.",
        "",
    ]


def _eval_section(ev: dict, has_plot: bool) -> list[str]:
    lines = [
        "## Evaluation", "",
        f"Held-out loss: **{ev['loss']:.4f}** nats/token (perplexity {math.exp(ev['loss']):.2f}) over "
        f"{ev['windows']} windows of {ev['seq_len']} tokens ({ev['predictions']:,} predictions), "
        "computed from the exported bf16 weights in fp32 on files used neither for training nor for "
        "choosing the weights. It equals the mean of transformers' `model(input_ids=w, labels=w).loss` "
        "over the windows.",
        "",
    ]
    if has_plot:
        lines += [f"![training loss]({LOSS_CURVE_FILE})", ""]
    return lines


def _limits_section(build_command: str) -> list[str]:
    return [
        "## Routing statistics", "", ROUTING_TODO, "",
        "## Limits", "",
        "- It completes Python source code and does not follow instructions. The chat template (ChatML) "
        "lets ferryman's chat API build a prompt; the chat stage (`--chat-minutes`, section \"Chat turns\") "
        "teaches it to end its answer with `<|im_end|>`, so agents get a finished turn.",
        "- It is tiny and trained for minutes: completions are often wrong, repetitive or invalid "
        "Python, and it may reproduce standard-library code it has seen.",
        "- It exists to demonstrate and test ferryman's expert offloading; do not use it for anything else.",
        "",
        "## Rebuild", "", f"`{build_command}` (see `docs/demo_model.md`).", "",
    ]


def write_model_card(out: Path, spec: BuildSpec, stats: dict, train: dict, ev: dict,
                     params: int, weights_bytes: int, has_plot: bool, build_command: str) -> None:
    """README.md of the export folder, every number taken from the run's records."""
    spec_json = spec.to_json()
    head = [
        "---", "license: apache-2.0", "library_name: transformers", "pipeline_tag: text-generation",
        "tags:", "- qwen3_moe", "- mixture-of-experts", "- code", "- ferryman", "---", "",
        "# ferryman demo MoE", "",
        "A small Qwen3-MoE code model trained on Python's standard library. ferryman bundles it to "
        "demonstrate and test running Mixture-of-Experts models whose experts live in host memory.",
        "",
    ]
    if spec.tiny:
        head += ["**Smoke-test build (`--tiny`)**: tiny model, few steps, a subset of the files.", ""]
    body = (_model_section(spec_json, params, weights_bytes) + _data_section(stats)
            + _training_section(spec_json, train) + _eval_section(ev, has_plot) + _limits_section(build_command))
    (out / "README.md").write_text("\n".join(head + body), encoding="utf-8")
