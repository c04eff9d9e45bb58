"""Routing locality of a model on real text, measured through ferryman.

    python benchmarks/bench_routing.py [--model FOLDER] [--max-tokens 16384] [--json out.json]

Default: the bundled demo model on the held-out files of its model card (those found in this
Python's stdlib), cut into 512-token windows, each prefilled with a routing trace attached. Per MoE
layer: the share of selections taken by the top 10% of experts, how often an expert chosen at
token t is chosen again within 1 and 8 tokens, and the hit rate of an LRU cache holding 10/25/50%
of the layer's experts (tools/demo_model/routing.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.demo_model.routing import FRACTIONS, markdown_table, measure  # noqa: E402

from ferryman import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the bundled demo model)")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    llm = LLM(a.model, device="cpu", dtype="float32")
    result = measure(llm, a.max_tokens, a.window)
    print(f"model: {a.model or 'bundled demo model'}; {result['tokens']} held-out tokens in {result['windows']} "
          f"windows; {result['experts']} experts, top-{result['top_k']}")
    print(markdown_table(result))
    E = result["experts"]
    print(f"uniform-routing baseline (hit rate = cache fraction): "
          f"{ {f'lru_{int(f * 100)}': round(f * E) / E for f in FRACTIONS} }")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
