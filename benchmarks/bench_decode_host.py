"""Host time of an offloaded decode layer's expert bookkeeping: `OffloadExperts.prepare_decode` (the
routing read, the plan, pinning the slots, copying misses, mapping ids to slots) and `finish_step`
(unpinning, the guesses' copies), for one token, as the engine runs them between a layer's graphs.

    python benchmarks/bench_decode_host.py [--model qwen3-30b-a3b] [--quantization int4] [--device cpu]
        [--calls 2000] [--profile] [--layers 2] [--link] [--cheap-router]

The model keeps its first --layers layers (random weights), `expert_cache="50%"`, warmed by random
routing of the first MoE layer. Two cases: every chosen expert cached (the bookkeeping alone) and
uniform random routing over all experts (the misses copied too). Medians of --calls calls,
microseconds. On CUDA the routing read includes the device sync; the kernels themselves are not run.
--link: beside them, the host work of one link-read step over all kept layers (publish, logged,
settle: experts/link_table.py), which replaces L copy-path layer steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fewer_layers import fewer_layers
from ferryman import LLM
from ferryman.experts.gpu_cache import ExpertCache
from ferryman.experts.link_table import LinkTable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", help="preset (default: qwen3-30b-a3b)")
    ap.add_argument("--quantization", default="int4", help="expert format (default: int4)")
    ap.add_argument("--device", default="cpu", help="default: cpu")
    ap.add_argument("--calls", type=int, default=2000, help="calls per case (default: 2000)")
    ap.add_argument("--profile", action="store_true", help="cProfile of the cached case")
    ap.add_argument("--layers", type=int, default=2, help="MoE layers kept (default: 2)")
    ap.add_argument("--cheap-router", action="store_true",
                    help="the guesses' router scores computed once and reused: on the CPU its GEMV would "
                         "dominate, where on CUDA it is a launch (the bookkeeping alone)")
    ap.add_argument("--link", action="store_true",
                    help="also a link-read step's host work over all those layers (decode_misses=link)")
    a = ap.parse_args()
    llm = LLM(fewer_layers(a.model, a.layers), load_format="dummy", device=a.device, moe_strategy="offload",
              expert_cache="50%", quantization=a.quantization, enforce_eager=True, max_model_len=512)
    ex, cfg = llm.engine.runner.experts, llm.engine.cfg
    layer, E, K = cfg.moe_layers[0], cfg.num_experts, cfg.top_k
    dev = llm.engine.device
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
    if a.cheap_router and ex.guesser is not None:  # x never changes: each gate's scores once
        ex.guesser.gates = {m: (lambda s: lambda _: s)(g(x)) for m, g in ex.guesser.gates.items()}

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
    if a.link:
        link_steps(ex.cache, K, a.calls, gen)
    if a.profile:
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(a.calls):
                one(cached)
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def link_steps(cache: ExpertCache, k: int, calls: int, gen: torch.Generator) -> None:
    """A link-read step's host work for all MoE layers at once (experts/link_table.py): publish the
    table, mark the step logged, settle its bookkeeping, for one token routed at random (the
    misses' copies included) or among each layer's cached experts."""
    link = LinkTable(cache, 1, k)
    e = cache.num_experts

    def step(cached_only: bool) -> float:
        for m, layer in enumerate(link.layers):
            pool = [x for x in range(e) if cache.contains(layer, x)] if cached_only else list(range(e))
            pool = pool if len(pool) >= k else list(range(e))
            link.log[m, 0] = torch.tensor(pool)[torch.randperm(len(pool), generator=gen)[:k]]
        t0 = time.perf_counter()
        link.publish()
        link.logged(1)
        link.settle()
        return time.perf_counter() - t0

    n = len(link.layers)
    for label, cached_only in (("cached only", True), ("random", False)):
        for _ in range(20):
            step(cached_only)
        t = statistics.median(step(cached_only) for _ in range(calls // 4))
        print(f"{label:12s} link step, {n} MoE layers: {t * 1e6:7.1f} us ({t / n * 1e6:6.1f} us per layer)")


if __name__ == "__main__":
    main()
