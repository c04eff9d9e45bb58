"""Routing locality of a model on real text, measured through ferryman.

    python benchmarks/bench_routing.py [--model FOLDER] [--max-tokens 16384] [--json out.json]

Default: the bundled demo model on the held-out split of this Python's standard library (test
folders excluded, as in its training corpus). Held-out files are cut into 512-token windows, each
window is prefilled with a routing trace attached, and per MoE layer we report: the share of
selections taken by the top 10% of experts, how often an expert chosen at token t is chosen again
within 1 and 8 tokens, and the hit rate of an LRU cache holding 10/25/50% of the layer's experts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.demo_model.config import CorpusSpec  # noqa: E402
from tools.demo_model.corpus import load_corpus, stdlib_root  # noqa: E402

from ferryman import LLM  # noqa: E402
from ferryman.experts.trace import RoutingTrace, attach_trace, lru_hit_rate, reuse_within, top_share  # noqa: E402

FRACTIONS = (0.10, 0.25, 0.50)


def heldout_texts(model_folder: Path) -> list[str]:
    """The model card's held-out files (corpus_stats.json) found in this Python's stdlib, else
    this stdlib's own held-out split."""
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


def layer_stats(ids: torch.Tensor, num_experts: int) -> dict:
    return {
        "top10_share": top_share(ids, num_experts, 0.10),
        "reuse_1": reuse_within(ids, 1),
        "reuse_8": reuse_within(ids, 8),
        **{f"lru_{int(f * 100)}": lru_hit_rate(ids, max(1, round(f * num_experts))) for f in FRACTIONS},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the bundled demo model)")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    llm = LLM(a.model, device="cpu", dtype="float32")
    windows = heldout_windows(llm, a.max_tokens, a.window)
    trace = RoutingTrace()
    attach_trace(llm.engine.runner.model, trace)
    for w in windows:
        llm.score([w])
    E = llm.engine.cfg.num_experts
    rows = {layer: layer_stats(trace.layer(layer), E) for layer in trace.layers}
    mean = {k: sum(r[k] for r in rows.values()) / len(rows) for k in next(iter(rows.values()))}
    tokens = sum(len(w) for w in windows)
    print(f"model: {a.model or 'bundled demo model'}; {tokens} held-out tokens in {len(windows)} windows; "
          f"{E} experts, top-{llm.engine.cfg.top_k}")
    print("| layer | top-10% share | reuse t+1 | reuse <=t+8 | LRU 10% | LRU 25% | LRU 50% |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in [*rows.items(), ("mean", mean)]:
        print(f"| {name} | {r['top10_share']:.3f} | {r['reuse_1']:.3f} | {r['reuse_8']:.3f} | "
              f"{r['lru_10']:.3f} | {r['lru_25']:.3f} | {r['lru_50']:.3f} |")
    uniform = {f"lru_{int(f * 100)}": round(f * E) / E for f in FRACTIONS}
    print(f"uniform-routing baseline (hit rate = cache fraction): {uniform}")
    if a.json:
        a.json.write_text(json.dumps({"tokens": tokens, "layers": rows, "mean": mean}, indent=2))


if __name__ == "__main__":
    main()
