"""flash-linear-attention's two gated delta rule kernels on one sequence of T tokens, at qwen3-next's
linear-attention shapes (Hk=16, Hv=32, D=128, bf16): the chunk kernel (given the host starts, as the
engine calls it) and the recurrent kernel. For each T: the host time until the call returns (what an
eager engine step pays per layer when the GPU keeps up) and the wall time of the call synchronised,
medians of --reps calls. Sets layers/delta_rule.py's FLA_RECURRENT_MAX_TOKENS (the longest prefill
segment that takes the recurrent kernel).

    python benchmarks/bench_delta_rule.py [--tokens 8,32,64,128,256,512,1024] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ferryman.layers.delta_rule import delta_rule_fla, fla_kernels

HK, HV, D = 16, 32, 128


def timed(call: object, reps: int) -> tuple[float, float]:
    """(host ms until return, wall ms synchronised), medians of reps calls after two warm-ups."""
    host, wall = [], []
    for i in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()  # type: ignore[operator]
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 2:
            host.append((t1 - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
    return statistics.median(host), statistics.median(wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8,32,64,128,256,512,1024")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    kernels = fla_kernels()
    if kernels is None or not torch.cuda.is_available():
        raise SystemExit("bench_delta_rule needs CUDA and flash-linear-attention")
    print(f"{'tokens':>7s} {'chunk host':>11s} {'chunk wall':>11s} {'recur host':>11s} {'recur wall':>11s}  (ms)")
    for T in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(T)
        q, k = (torch.randn(T, HK, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(T, HV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
        g = -torch.rand(T, HV, device="cuda", generator=gen)  # log decay <= 0
        beta = torch.rand(T, HV, device="cuda", generator=gen).bfloat16()
        init = torch.zeros(1, HV, D, D, device="cuda")
        starts = torch.tensor([0, T], device="cuda")
        # the chunk kernel as the engine calls it past the limit: the host starts as cu_seqlens_cpu
        chunk_only = {"chunk": lambda **kw: kernels["chunk"](**kw, cu_seqlens_cpu=torch.tensor([0, T]))}
        chunk = timed(lambda: delta_rule_fla(q, k, v, g, beta, starts, init, False, chunk_only), args.reps)
        recur = timed(lambda: delta_rule_fla(q, k, v, g, beta, starts, init, True, kernels), args.reps)
        print(f"{T:7d} {chunk[0]:11.3f} {chunk[1]:11.3f} {recur[0]:11.3f} {recur[1]:11.3f}")


if __name__ == "__main__":
    main()
