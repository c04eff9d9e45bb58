"""Routing statistics of an exported model, measured through ferryman on held-out stdlib text.

Used by the build (model card) and by benchmarks/bench_routing.py (docs/routing.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from ferryman import LLM
from tools.demo_model.card import put_card_section
from tools.demo_model.trace import RoutingTrace, attach_trace, lru_hit_rate, reuse_within, top_share
from tools.demo_model.config import CorpusSpec
from tools.demo_model.corpus import load_corpus, stdlib_root

FRACTIONS = (0.10, 0.25, 0.50)
CARD_MARK = "## Routing statistics"


def heldout_texts(model_folder: Path) -> list[str]:
    """The model card's held-out files (corpus_stats.json) found in this Python's stdlib, else this
    stdlib's own held-out split (test folders excluded)."""
    stats = model_folder / "corpus_stats.json"
    if stats.exists():
        root = stdlib_root()
        names = json.loads(stats.read_text()).get("heldout_files", [])
        texts = [(root / n).read_text(encoding="utf-8", errors="replace") for n in names if (root / n).exists()]
        if texts:
            return texts
    return load_corpus(CorpusSpec(include_tests=False)).texts("heldout")


def heldout_windows(llm: LLM, max_tokens: int, window: int) -> list[list[int]]:
    eos = llm.tokenizer.eos_token_id
    stream: list[int] = []
    for text in heldout_texts(Path(llm.config.model)):
        stream += llm.tokenizer.encode(text, add_special_tokens=False) + [eos]
        if len(stream) >= max_tokens:
            break
    stream = stream[:max_tokens]
    return [stream[i : i + window] for i in range(0, len(stream) - window + 1, window)]


def layer_stats(ids, num_experts: int) -> dict[str, float]:
    """ids: [T, K] one layer's selections in token order."""
    return {
        "top10_share": top_share(ids, num_experts, 0.10),
        "reuse_1": reuse_within(ids, 1),
        "reuse_8": reuse_within(ids, 8),
        **{f"lru_{int(f * 100)}": lru_hit_rate(ids, max(1, round(f * num_experts))) for f in FRACTIONS},
    }


def measure(llm: LLM, max_tokens: int = 16384, window: int = 512) -> dict:
    """Prefill held-out windows with a routing trace attached; per-layer and mean statistics."""
    windows = heldout_windows(llm, max_tokens, window)
    if not windows:
        raise ValueError(f"no held-out text for a {window}-token window")
    trace = RoutingTrace()
    attach_trace(llm.engine.runner.model, trace)
    try:
        for w in windows:
            llm.score([w])
    finally:
        attach_trace(llm.engine.runner.model, None)
    E = llm.engine.cfg.num_experts
    rows = {layer: layer_stats(trace.layer(layer), E) for layer in trace.layers}
    mean = {k: sum(r[k] for r in rows.values()) / len(rows) for k in next(iter(rows.values()))}
    return {"tokens": sum(map(len, windows)), "windows": len(windows), "experts": E,
            "top_k": llm.engine.cfg.top_k, "layers": rows, "mean": mean}


def markdown_table(result: dict) -> str:
    lines = ["| layer | top-10% share | reuse t+1 | reuse <=t+8 | LRU 10% | LRU 25% | LRU 50% |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in [*result["layers"].items(), ("mean", result["mean"])]:
        lines.append(f"| {name} | {r['top10_share']:.3f} | {r['reuse_1']:.3f} | {r['reuse_8']:.3f} | "
                     f"{r['lru_10']:.3f} | {r['lru_25']:.3f} | {r['lru_50']:.3f} |")
    return "\n".join(lines)


def card_section(result: dict) -> str:
    E, m = result["experts"], result["mean"]
    uniform = " / ".join(f"{round(f * E) / E:.0%}" for f in FRACTIONS)
    return (
        f"Measured through ferryman (`python benchmarks/bench_routing.py`) on {result['tokens']:,} tokens of the "
        f"held-out files listed in `corpus_stats.json` found in the measuring Python's stdlib, in "
        f"{result['windows']} windows. Per MoE layer: the share of selections taken by the most-selected 10% of "
        f"experts; how often an expert chosen at token t is chosen again at t+1 and within t+1..t+8; the hit rate "
        f"of an LRU cache holding 10/25/50% of the layer's experts, fed token by token.\n\n"
        f"{markdown_table(result)}\n\n"
        f"An LRU cache of 10/25/50% of the experts hits {m['lru_10']:.0%} / {m['lru_25']:.0%} / {m['lru_50']:.0%} "
        f"of selections; uniform routing would give {uniform}."
    )


def fill_card(folder: Path, result: dict) -> None:
    """Replace the card's routing section body with the measured statistics."""
    put_card_section(folder / "README.md", CARD_MARK, card_section(result))
