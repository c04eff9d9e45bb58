"""One projection of a packed format through the CPU kernel (`ferryman_cpu_matmul`), this tree's
kernel against another tree's, alternated in one process.

    python benchmarks/bench_cpu_matmul.py --against /path/to/other/tree [--format gguf:q4_k:q4_k]
        [--proj w13] [--tokens 1,2,3] [--experts 64] [--threads 1]

qwen3-30b-a3b's expert shape (H 2048, I 768) unless --hidden / --inter say otherwise; each timed
round multiplies every one of --experts random experts once (64 of them: about 110 MB of Q4_K w13,
more than the caches, as misses are), best of --reps rounds and of 3 alternations, microseconds per
matrix. The other tree's kernel is built from its ferryman/quant/csrc.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch

from ferryman.quant import get_format
from ferryman.quant.cpu_kernel import ISAS, build, format_code, need_library, packed_inputs


def per_matrix(lib: ctypes.CDLL, code: int, w: torch.Tensor, x: torch.Tensor, n: int, threads: int,
               reps: int) -> float:
    """Best seconds per matrix over `reps` rounds through every expert of w [E, N, bytes]."""
    y = torch.empty(x.shape[0], n)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for e in range(w.shape[0]):
            lib.ferryman_cpu_matmul(code, 0, x.data_ptr(), x.shape[0], x.shape[1], w[e].data_ptr(), None, None, n,
                                    y.data_ptr(), threads, ISAS["avx512bf16"])
        best = min(best, (time.perf_counter() - t0) / w.shape[0])
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, required=True, help="the other tree (its ferryman/quant/csrc is built)")
    ap.add_argument("--format", default="gguf:q4_k:q4_k", help="a GGUF format gguf:<w13>:<w2> (default q4_k)")
    ap.add_argument("--proj", default="w13", choices=["w13", "w2"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", default="1,2,3")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    if not a.format.startswith("gguf:"):
        raise SystemExit("bench_cpu_matmul: --format must be a GGUF format gguf:<w13>:<w2> (its banks have no scales)")
    ours = need_library(None)
    theirs, why = build(csrc=a.against / "ferryman" / "quant" / "csrc")
    if theirs is None:
        raise SystemExit(f"bench_cpu_matmul: could not build {a.against}'s kernel: {why}")
    banks = get_format(a.format).random_banks(a.experts, a.hidden, a.inter, False, torch.float32,
                                              torch.Generator().manual_seed(0))
    w = banks[f"{a.proj}_q"]  # [E, N, row bytes]
    gtype = a.format.split(":")[1 if a.proj == "w13" else 2]
    one = f"gguf:{gtype}:{gtype}"  # the projection's own type, read as a w13
    code = format_code(one, torch.uint8)
    if code is None:
        raise SystemExit(f"bench_cpu_matmul: the CPU kernel does not read {gtype} blocks (--format {a.format})")
    k = packed_inputs(one, w[0])
    print(f"{a.format} {a.proj}: [{w.shape[1]} x {k}], {a.experts} experts, {a.threads} thread(s); against {a.against}")
    for t in (int(v) for v in a.tokens.split(",")):
        x = torch.randn(t, k)
        best = {"this": float("inf"), "other": float("inf")}
        for _ in range(3):
            best["other"] = min(best["other"], per_matrix(theirs, code, w, x, w.shape[1], a.threads, a.reps))
            best["this"] = min(best["this"], per_matrix(ours, code, w, x, w.shape[1], a.threads, a.reps))
        print(f"{t} token(s): other {best['other'] * 1e6:8.1f} us  this {best['this'] * 1e6:8.1f} us  "
              f"x{best['other'] / best['this']:.2f}")


if __name__ == "__main__":
    main()
