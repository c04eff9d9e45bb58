"""Host time of one cuBLAS launch through torch, by preferred BLAS backend: the batched prefill path's
`torch.bmm` and the dense layers' `F.linear` at gpt-oss-20b's shapes (a 4096-token chunk, groups of 8
experts). Launch-side time only: the GPU work of a call is queued behind a long sleep kernel, so the
host never waits for it. "rows varying" gives each bmm call its own row count (520 + i % 97, as the
groups' longest runs vary), "in steps of 64" the same rounded up to a multiple of 64.

    python benchmarks/bench_blas_launch.py [--calls 200]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def host_us(fn, calls: int) -> float:  # noqa: ANN001
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU: every launch below queues behind it
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = time.perf_counter() - t
    torch.cuda.synchronize()
    return spent / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    xs = torch.randn(8, 520, 2880, device=dev, dtype=bf)
    w13 = torch.randn(8, 5760, 2880, device=dev, dtype=bf)
    x = torch.randn(4096, 2880, device=dev, dtype=bf)
    wq, bq = torch.randn(5120, 2880, device=dev, dtype=bf), torch.randn(5120, device=dev, dtype=bf)
    big = torch.randn(8, 640, 2880, device=dev, dtype=bf)
    calls = iter(range(10**9))

    def varying(step: int = 1) -> torch.Tensor:
        m = 520 + next(calls) % 97
        return torch.bmm(big[:, : -(-m // step) * step], w13.transpose(1, 2))

    cases = {"bmm [8,520,2880]x[8,2880,5760]": lambda: torch.bmm(xs, w13.transpose(1, 2)),
             "bmm, rows varying 520-616": varying,
             "bmm, rows varying, in steps of 64": lambda: varying(64),
             "linear+bias [4096,2880]x[2880,5120]": lambda: F.linear(x, wq, bq),
             "linear [4096,2880]x[2880,5120]": lambda: F.linear(x, wq)}
    for lib in ("default", "cublas", "cublaslt"):
        if lib != "default":
            torch.backends.cuda.preferred_blas_library(lib)
        for name, fn in cases.items():
            fn()  # warm: heuristics, workspace
            print(f"{lib:9s} {name:38s} {host_us(fn, a.calls):7.1f} us per launch", flush=True)


if __name__ == "__main__":
    main()
