"""The host's fixed cost of one CPU layer job, beside the kernel's own work: `cpu_kernel.pairs_of` and
`LayerJob`'s construction (quant/cpu_layer.py), which the hybrid split and the cpu / layers
strategies pay per MoE layer on the engine's thread, and the CPU device per layer of every step.

    python benchmarks/bench_layer_job.py [--tokens 1,1500] [--calls 2000]

gpt-oss-20b's expert shape (MXFP4, biases, top-4 of 32); one token routes to 4 experts, a prompt's
tokens to all 32. Microseconds per call, best of 3 rounds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ferryman.quant import cpu_kernel  # noqa: E402
from ferryman.quant.base import get_format  # noqa: E402
from ferryman.quant.cpu_layer import LayerJob  # noqa: E402


def best_us(fn, calls: int) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,1500", help="tokens per job (default: %(default)s)")
    p.add_argument("--calls", type=int, default=2000, help="calls per round (default: %(default)s)")
    a = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    banks = get_format("mxfp4").random_banks(32, 2880, 2880, True, torch.bfloat16, gen)
    for t in (int(x) for x in a.tokens.split(",")):
        ids = torch.stack([torch.randperm(32, generator=gen)[:4] for _ in range(t)])
        w = torch.rand(t, 4, generator=gen)
        x = torch.randn(t, 2880, generator=gen).bfloat16()
        experts = sorted(set(ids.reshape(-1).tolist()))
        pairs = cpu_kernel.pairs_of(ids, w, experts)
        bias: dict = {}
        calls = max(10, a.calls // max(1, t // 16))
        p_us = best_us(lambda: cpu_kernel.pairs_of(ids, w, experts), calls)  # noqa: B023
        j_us = best_us(lambda: LayerJob(x, banks, 0, pairs, "swiglu_oai", 1.702, 7.0, bias), calls)  # noqa: B023
        print(f"{t:5d} token(s), {len(experts)} experts: pairs_of {p_us:8.1f} us, LayerJob {j_us:8.1f} us")


if __name__ == "__main__":
    main()
