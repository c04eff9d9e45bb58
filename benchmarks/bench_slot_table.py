"""Host bookkeeping of one offloaded decode layer step: SlotTable.acquire + release under a policy.

    python benchmarks/bench_slot_table.py [--slots 277] [--used 28] [--steps 50]

gpt-oss-20b's geometry by default (24 MoE layers x 32 experts, the 277 slots of the 16-user serve
plan) with `--used` distinct experts per layer step drawn at random, as 16 sequences of dummy
weights route. No tensors and no copies: the Python cost the host pays per layer step before the
copies are issued. Prints microseconds per layer step for each policy.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ferryman.experts.slot_table import SlotTable  # noqa: E402
from ferryman.experts.policies import POLICIES, make_policy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--slots", type=int, default=277)
    ap.add_argument("--used", type=int, default=28, help="distinct experts per layer step")
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    if not 1 <= a.used <= min(a.experts, a.slots):
        raise SystemExit(f"--used must be 1..{min(a.experts, a.slots)}, got {a.used}")
    for name in sorted(POLICIES):
        table, rng = SlotTable(a.slots, make_policy(name)), random.Random(0)
        misses = 0
        start = time.perf_counter()
        for _ in range(a.steps):
            getattr(table.policy, "advance", lambda: None)()
            for layer in range(a.layers):
                keys = [layer * a.experts + e for e in sorted(rng.sample(range(a.experts), a.used))]
                misses += len(table.acquire(keys).filled)
                table.release(keys)
        spent = (time.perf_counter() - start) / (a.steps * a.layers)
        print(f"{name}: {spent * 1e6:.0f} us per layer step ({a.used} used, "
              f"{misses / (a.steps * a.layers):.1f} misses, {a.slots} slots)")


if __name__ == "__main__":
    main()
