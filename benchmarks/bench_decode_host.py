"""Host time of an offloaded decode layer's expert bookkeeping: `OffloadExperts.prepare_decode` (the
routing read, the plan, pinning the slots, copying misses, mapping ids to slots) and `finish_step`
(unpinning, the guesses' copies), for one token, as the engine runs them between a layer's graphs.

    python benchmarks/bench_decode_host.py [--model qwen3-30b-a3b] [--quantization int4] [--device cpu]
        [--calls 2000] [--profile]

The model keeps its first 2 layers (random weights), `expert_cache="50%"`, warmed by random routing
first. Two cases: every chosen expert cached (the bookkeeping alone) and uniform random routing over
all experts (the misses copied too). Medians of --calls calls, microseconds. On CUDA the
routing read includes the device sync; the kernels themselves are not run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fewer_layers import fewer_layers
from ferryman import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", help="preset (default: qwen3-30b-a3b)")
    ap.add_argument("--quantization", default="int4", help="expert format (default: int4)")
    ap.add_argument("--device", default="cpu", help="default: cpu")
    ap.add_argument("--calls", type=int, default=2000, help="calls per case (default: 2000)")
    ap.add_argument("--profile", action="store_true", help="cProfile of the cached case")
    a = ap.parse_args()
    llm = LLM(fewer_layers(a.model, 2), load_format="dummy", device=a.device, moe_strategy="offload",
              expert_cache="50%", quantization=a.quantization, enforce_eager=True, max_model_len=512)
    ex, cfg = llm.engine.runner.experts, llm.engine.cfg
    layer, E, K = cfg.moe_layers[0], cfg.num_experts, cfg.top_k
    dev = llm.engine.device
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, cfg.hidden_size, dtype=torch.bfloat16, device=dev)

    def one(pool: list[int]) -> tuple[float, float]:
        ids = torch.tensor(pool)[torch.randperm(len(pool), generator=gen)[:K]].view(1, K).to(dev)
        w = torch.rand(1, K, device=dev)
        t0 = time.perf_counter()
        step = ex.prepare_decode(layer, x, ids, w)
        t1 = time.perf_counter()
        ex.finish_step(step)
        return t1 - t0, time.perf_counter() - t1

    everything = list(range(E))
    for _ in range(300):  # warm the cache with random routing
        one(everything)
    cached = [e for e in everything if ex.cache.contains(layer, e)]
    print(f"{a.model} ({a.quantization}, {dev}): {len(cached)} of {E} experts of layer {layer} cached, top-{K}")
    for label, pool in (("cached only", cached), ("random", everything)):
        for _ in range(50):
            one(pool)
        r = [one(pool) for _ in range(a.calls)]
        print(f"{label:12s} prepare_decode {statistics.median(p for p, _ in r) * 1e6:7.1f} us   "
              f"finish_step {statistics.median(f for _, f in r) * 1e6:6.1f} us")
    if a.profile:
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(a.calls):
                one(cached)
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
