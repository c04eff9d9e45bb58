"""CPU MXFP4 expert products: the C kernel (quant/cpu_kernel.py) against the torch path it replaces
(dequantise to the activation dtype, then a matmul), on gpt-oss expert shapes.

    python benchmarks/bench_cpu_mxfp4.py [--tokens 1,2,4,8] [--threads 0,8] [--pool-mib 512]
    python benchmarks/bench_cpu_mxfp4.py --matrix [--against /path/to/other/tree] [--tokens 1,4,8,32]

Prints, per token count and thread count, the time of one expert (gate_up [2I, H] then down
[H, I]), its rate in experts/s and GB/s of MXFP4 bytes, the ratio to the torch path measured in
the same run, and the ratio to the host read bandwidth measured in the same run. Experts cycle
through a pool larger than the CPU caches, as misses do.

--matrix: the kernel's arithmetic instead: one thread, one --rows x --hidden matrix that stays in
L2/L3, MXFP4 and bf16 weights, best of --calls calls, in microseconds per matrix (and the MAC rate);
--against builds another tree's kernel (its ferryman/quant/csrc) and times it in the same process.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from ferryman.quant.mxfp4 import dequant_mxfp4, random_mxfp4
from ferryman.quant import cpu_kernel


def _experts(n: int, hidden: int, inter: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    return [(*random_mxfp4((2 * inter, hidden), gen), *random_mxfp4((hidden, inter), gen)) for _ in range(n)]


def _time(fn, reps: int) -> float:  # noqa: ANN001
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def _best(fn, calls: int) -> float:  # noqa: ANN001
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matrix_main(a: argparse.Namespace) -> None:
    """Microseconds per matrix, one thread, this tree's kernel and --against's, same weights."""
    libs = {"this tree": cpu_kernel.build()}
    if a.against:
        libs = {a.against: cpu_kernel.build(csrc=Path(a.against) / "ferryman/quant/csrc"), **libs}
    for name, (lib, how) in libs.items():
        if lib is None:
            raise SystemExit(f"{name}: the kernel did not build: {how}")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    blocks, scales = random_mxfp4((a.rows, a.hidden), gen)
    dense = torch.randn(a.rows, a.hidden, generator=gen).bfloat16()
    isa = min(a.isa, cpu_kernel.isa_name(libs["this tree"][0]), key=cpu_kernel.ISAS.__getitem__)
    print(f"one thread, {a.rows} x {a.hidden} matrix, best of {a.calls} calls; ISA {isa}")
    print(f"{'format':6s} {'tokens':>6s} " + " ".join(f"{name[-24:]:>24s}" for name in libs) + "   ratio")
    for fmt, w, s in (("mxfp4", blocks, scales), ("bf16", dense, None)):
        for t in (int(v) for v in a.tokens.split(",")):
            x = torch.randn(t, a.hidden, generator=gen)
            us = []
            for lib, _ in libs.values():
                us.append(_best(lambda: cpu_kernel.matmul(x, w, s, "mxfp4" if fmt == "mxfp4" else "dense", a.isa,
                                                          lib=lib), a.calls) * 1e6)
            macs = [t * a.rows * a.hidden / u / 1e3 for u in us]
            print(f"{fmt:6s} {t:6d} " + " ".join(f"{u:9.1f} us {m:6.1f} GMAC/s" for u, m in zip(us, macs))
                  + (f"   {us[0] / us[-1]:.2f}x" if len(us) > 1 else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--threads", default="0", help="kernel threads to try (0: torch.get_num_threads())")
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--inter", type=int, default=2880)
    ap.add_argument("--pool-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3, help="passes over the pool")
    ap.add_argument("--matrix", action="store_true", help="one matrix in the caches, one thread (see above)")
    ap.add_argument("--against", metavar="TREE", help="--matrix: also time the kernel of this source tree")
    ap.add_argument("--rows", type=int, default=256, help="--matrix: rows of the matrix")
    ap.add_argument("--calls", type=int, default=300, help="--matrix: calls per figure (the best is kept)")
    ap.add_argument("--isa", default="avx512bf16", choices=list(cpu_kernel.ISAS),
                    help="--matrix: the most the kernels may use")
    a = ap.parse_args()
    if a.matrix:
        matrix_main(a)
        return
    default_threads = torch.get_num_threads()
    if not cpu_kernel.available():
        raise SystemExit("the CPU MXFP4 kernel is unavailable here (see the warning above)")
    per_expert = 3 * a.hidden * a.inter * 17 // 32  # blocks + scales bytes of w13 and w2
    pool = _experts(max(2, (a.pool_mib << 20) // per_expert), a.hidden, a.inter)
    big = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    read = big.numel() * 4 / _time(lambda: big.sum(), 5) / 1e9
    del big
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}; expert {per_expert / 2**20:.2f} MiB; pool {len(pool)} experts; "
          f"host read {read:.1f} GB/s")
    for t in (int(v) for v in a.tokens.split(",")):
        x = torch.randn(t, a.hidden)
        h = torch.randn(t, a.inter)

        def kernel_pass() -> None:
            for b13, s13, b2, s2 in pool:
                cpu_kernel.matmul(x, b13, s13)
                cpu_kernel.matmul(h, b2, s2)

        def torch_pass() -> None:
            for b13, s13, b2, s2 in pool[:4]:
                x.bfloat16() @ dequant_mxfp4(b13, s13, torch.bfloat16).T
                h.bfloat16() @ dequant_mxfp4(b2, s2, torch.bfloat16).T

        ref = _time(torch_pass, 1) / 4
        for threads in (int(v) for v in a.threads.split(",")):
            torch.set_num_threads(threads or default_threads)  # the kernel runs torch's thread count
            sec = _time(kernel_pass, a.reps) / len(pool)
            torch.set_num_threads(default_threads)
            print(f"tokens {t:2d} threads {threads or default_threads:2d}: {sec * 1e3:6.3f} ms/expert, "
                  f"{1 / sec:7.0f} experts/s, {per_expert / sec / 1e9:5.1f} GB/s ({per_expert / sec / 1e9 / read:.2f} "
                  f"of host read); torch path {ref * 1e3:.1f} ms/expert: kernel {ref / sec:.0f}x faster")


if __name__ == "__main__":
    main()
