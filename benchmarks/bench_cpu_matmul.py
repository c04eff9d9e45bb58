"""One projection of a packed format through the CPU kernel (`ferryman_cpu_matmul`), this tree's
kernel against another tree's, alternated in one process.

    python benchmarks/bench_cpu_matmul.py --against /path/to/other/tree [--format gguf:q4_k:q4_k]
        [--proj w13] [--tokens 1,2,3] [--experts 64] [--threads 1]

--format: a GGUF format (either projection), int4 / int8 / fp8 / nvfp4 (w13: words or codes with
their scales, zeros or global scales), mxfp4 or dense (bf16 w13).

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
from ferryman.quant.cpu_kernel import ISAS, build, format_code, need_library, packed_codes, packed_inputs


Parts = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # [E, ...] weights, scales, zeros


def per_matrix(lib: ctypes.CDLL, code: int, group: int, parts: Parts, x: torch.Tensor, n: int, threads: int,
               reps: int, isa: str = "avx512bf16") -> float:
    """Best seconds per matrix over `reps` rounds through every expert of the parts."""
    y = torch.empty(x.shape[0], n)
    w, s, z = parts
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for e in range(w.shape[0]):
            lib.ferryman_cpu_matmul(code, group, x.data_ptr(), x.shape[0], x.shape[1], w[e].data_ptr(),
                                    s[e].data_ptr() if s is not None else None,
                                    z[e].data_ptr() if z is not None else None, n, y.data_ptr(), threads,
                                    ISAS[isa])
        best = min(best, (time.perf_counter() - t0) / w.shape[0])
    return best


def matrices(fmt: str, proj: str, banks: dict[str, torch.Tensor]) -> tuple[str, Parts]:
    """(the format the kernel reads the projection as, its parts): a GGUF projection of its own type
    read as a w13; int and fp8 w13 with their scales (and zeros)."""
    if fmt.startswith("gguf:"):
        gtype = fmt.split(":")[1 if proj == "w13" else 2]
        return f"gguf:{gtype}:{gtype}", (banks[f"{proj}_q"], None, None)
    if proj != "w13":
        raise SystemExit(f"bench_cpu_matmul: --proj w2 is for GGUF formats (got --format {fmt})")
    if fmt.startswith("fp8"):
        return fmt, (banks["w13"], banks["w13_scale"], None)
    if fmt == "mxfp4":
        return fmt, (banks["w13_blocks"], banks["w13_scales"], None)
    if fmt.startswith("nvfp4"):  # zeros: the global scales, gate's and up's
        return fmt, (banks["w13_packed"], banks["w13_scale"], banks["w13_gscale"])
    if fmt == "dense":
        return fmt, (banks["w13"], None, None)
    return fmt, (banks["w13_qweight"], banks["w13_scales"], banks.get("w13_zeros"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, required=True, help="the other tree (its ferryman/quant/csrc is built)")
    ap.add_argument("--format", default="gguf:q4_k:q4_k",
                    help="gguf:<w13>:<w2>, int4|int8:<g<n>|ch>:<sym|asym>, fp8:<b>x<b>|channel, mxfp4 or dense "
                         "(default: %(default)s)")
    ap.add_argument("--proj", default="w13", choices=["w13", "w2"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", default="1,2,3")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", default="avx512bf16", choices=list(ISAS),
                    help="the most the kernels may use, e.g. avx2 for an AVX2 machine's path (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    if a.format not in ("mxfp4", "dense") and packed_codes(a.format) is None:
        raise SystemExit(f"bench_cpu_matmul: --format {a.format}: the CPU kernel does not read it")
    ours = need_library(None)
    theirs, why = build(csrc=a.against / "ferryman" / "quant" / "csrc")
    if theirs is None:
        raise SystemExit(f"bench_cpu_matmul: could not build {a.against}'s kernel: {why}")
    dtype = torch.bfloat16 if a.format == "dense" else torch.float32  # dense: bf16 banks, as checkpoints
    banks = get_format(a.format).random_banks(a.experts, a.hidden, a.inter, False, dtype,
                                              torch.Generator().manual_seed(0))
    one, parts = matrices(a.format, a.proj, banks)
    w = parts[0]  # [E, N, row bytes or words]
    code, group = format_code(one, w.dtype), (packed_codes(one) or (0, 0, 0))[2]
    if one.startswith("nvfp4"):  # rows per global scale (cpu_kernel.matmul's rule)
        group = w.shape[1] // parts[2].shape[1]
    if code is None:
        raise SystemExit(f"bench_cpu_matmul: the CPU kernel does not read {one} (--format {a.format})")
    per = 32 if one == "mxfp4" else 2 if one.startswith("nvfp4") else 1  # inputs per byte or block of dim 2
    k = packed_inputs(one, w[0]) if one.startswith(("gguf", "int")) else w.shape[2] * per
    print(f"{a.format} {a.proj}: [{w.shape[1]} x {k}], {a.experts} experts, {a.threads} thread(s), ISA up to {a.isa}; "
          f"against {a.against}")
    for t in (int(v) for v in a.tokens.split(",")):
        x = torch.randn(t, k)
        best = {"this": float("inf"), "other": float("inf")}
        for _ in range(3):
            for name, lib in (("other", theirs), ("this", ours)):
                seconds = per_matrix(lib, code, group, parts, x, w.shape[1], a.threads, a.reps, a.isa)
                best[name] = min(best[name], seconds)
        print(f"{t} token(s): other {best['other'] * 1e6:8.1f} us  this {best['this'] * 1e6:8.1f} us  "
              f"x{best['other'] / best['this']:.2f}")


if __name__ == "__main__":
    main()
