"""Routing skew of one prefill chunk, per MoE layer, on any device (CPU is fine, slowly): the
padding that batched_moe's groups of 8 experts in id order would add, as a share of the pairs,
and the padding after `expert_groups` (which regroups by run length past PAD_SLACK).

    python tools/routing_skew.py gpt-oss-20b --tokens 4096      # dummy weights, ~16 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ferryman import LLM, SamplingParams  # noqa: E402
from ferryman.layers import moe  # noqa: E402
from ferryman.layers.batched_moe import PAD_SLACK, expert_groups, padded_rows, slot_order_groups  # noqa: E402

GROUP = 8


def padding(counts: list[int], groups: list[list[int]]) -> float:
    """Padded rows beyond the pairs, as a share of the pairs."""
    return padded_rows(counts, groups) / sum(counts) - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a preset (dummy weights) or a checkpoint folder")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens, one chunk")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--load-format", default="dummy")
    a = ap.parse_args()
    rows: list[tuple[int, float, float]] = []
    real = moe.SparseMoE.compute

    def compute(self: moe.SparseMoE, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] >= a.tokens:  # the prompt's chunk, not a decode step
            flat = ids.flatten().tolist()
            counts = [flat.count(e) for e in sorted(set(flat))]
            in_order = slot_order_groups(len(counts), GROUP)
            rows.append((self.layer, padding(counts, in_order), padding(counts, expert_groups(counts, GROUP))))
            print(f"layer {self.layer:3d}: {len(counts)} experts, the busiest {max(counts)} of {len(flat)} pairs; "
                  f"padding in id order {rows[-1][1]:.3f}, as grouped {rows[-1][2]:.3f}", flush=True)
        return real(self, x, ids, w)

    moe.SparseMoE.compute = compute  # type: ignore[method-assign]
    llm = LLM(a.model, load_format=a.load_format, device=a.device, dtype="bfloat16",
              max_model_len=a.tokens + 16, max_num_batched_tokens=a.tokens)
    prompt = torch.randint(1, llm.engine.cfg.vocab_size, (a.tokens,), generator=torch.Generator().manual_seed(0))
    llm.generate(prompt_token_ids=[prompt.tolist()], params=SamplingParams(max_tokens=1))
    if rows:
        print(f"{len(rows)} layers: padding in id order mean {statistics.mean(r[1] for r in rows):.3f}, max "
              f"{max(r[1] for r in rows):.3f}; as grouped mean {statistics.mean(r[2] for r in rows):.3f}; "
              f"{sum(r[1] > PAD_SLACK for r in rows)} layers regrouped (PAD_SLACK {PAD_SLACK})")


if __name__ == "__main__":
    main()
