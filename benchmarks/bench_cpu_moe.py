"""CPU MoE of one layer by token count: the C kernel (quant/cpu_kernel.py, what `fused_moe` takes
for dense experts when it is built) beside the torch paths, the gathered batch and the per-expert
loop, and which torch path `fused_moe` picks without the kernel (GATHER_MAX_COPIES, GATHER_MAX_BYTES).

    python benchmarks/bench_cpu_moe.py [--tokens 1,4,8,16,32,64,128] [--dtype bfloat16] [--format dense]

--format: a packed expert format (gguf:q8_0:q8_0, gguf:q4_k:q6_k, int4:g128:sym, fp8:128x128, ...):
the kernel beside the torch path fused_moe takes without it (weights dequantised to --dtype, gathered
or looped as gather_pays says), only that one (the other may need many GiB at these shapes).

Shapes: the bundled demo model's layer (bf16 dense experts, 32 experts, top-4, 256 x 64) unless
--experts/--top-k/--hidden/--inter say otherwise; random weights and routing (each token's top-k
distinct). Median of --reps calls each; the ratios are the loop's time over the gathered path's and
the faster torch path's over the kernel's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import median_seconds  # noqa: E402

from ferryman.layers.fused_moe import gather_pays  # noqa: E402
from ferryman.quant.cpu_kernel import available, pairs_of  # noqa: E402
from ferryman.quant.cpu_layer import LayerJob, kernel_reads  # noqa: E402
from ferryman.layers.moe_common import MoEActivation  # noqa: E402
from ferryman.layers.moe_reference import fused_moe_gathered, fused_moe_reference  # noqa: E402
from ferryman.quant import get_format  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,4,8,16,32,64,128")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=64)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--format", default="dense")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    if a.format != "dense":
        packed(a, dtype)
        return
    form, act = get_format("dense"), MoEActivation("silu")
    gen = torch.Generator().manual_seed(0)
    banks = form.random_banks(a.experts, a.hidden, a.inter, False, dtype, gen)
    print(f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}; {a.experts} experts, top-{a.top_k}, "
          f"H {a.hidden}, I {a.inter}, {a.dtype}")
    kernel = available("dense", dtype)
    print("| tokens | pairs | distinct experts | gathered ms | loop ms | loop / gathered | torch picks | C kernel ms "
          "| torch / kernel |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for t in (int(s) for s in a.tokens.split(",")):
        x = torch.randn(t, a.hidden, generator=gen).to(dtype)
        ids = torch.rand(t, a.experts, generator=gen).topk(a.top_k, dim=-1).indices  # [T, K]
        w = torch.softmax(torch.randn(t, a.top_k, generator=gen), -1)
        tg = median_seconds(lambda: fused_moe_gathered(form, banks, x, ids, w, act), a.reps, warmup=1) * 1e3
        tl = median_seconds(lambda: fused_moe_reference(form, banks, x, ids, w, act), a.reps, warmup=1) * 1e3
        picks = "gathered" if gather_pays(form, banks, ids, x) else "loop"
        tk = median_seconds(lambda: LayerJob(x, banks, 0, pairs_of(ids, w), "silu", act.alpha, act.limit,
                                             fmt="dense").run().to(dtype), a.reps, warmup=1) * 1e3 if kernel else None
        cells = "- | -" if tk is None else f"{tk:.2f} | {min(tg, tl) / tk:.2f}"
        print(f"| {t} | {ids.numel()} | {torch.unique(ids).numel()} | {tg:.2f} | {tl:.2f} | {tl / tg:.2f} | {picks} "
              f"| {cells} |", flush=True)


def packed(a: argparse.Namespace, dtype: torch.dtype) -> None:
    """The C kernel against the torch path fused_moe picks without it, for a packed format."""
    form, act = get_format(a.format), MoEActivation("silu")
    gen = torch.Generator().manual_seed(0)
    banks = form.random_banks(a.experts, a.hidden, a.inter, False, dtype, gen)
    print(f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}; {a.experts} experts, top-{a.top_k}, "
          f"H {a.hidden}, I {a.inter}, {a.format}, activations {a.dtype}")
    kernel = kernel_reads(a.format, banks)
    print("| format | tokens | pairs | torch path | torch ms | C kernel ms | torch / kernel |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for t in (int(s) for s in a.tokens.split(",")):
        x = torch.randn(t, a.hidden, generator=gen).to(dtype)
        ids = torch.rand(t, a.experts, generator=gen).topk(a.top_k, dim=-1).indices  # [T, K]
        w = torch.softmax(torch.randn(t, a.top_k, generator=gen), -1)
        gathered = gather_pays(form, banks, ids, x)
        path = fused_moe_gathered if gathered else fused_moe_reference
        tt = median_seconds(lambda: path(form, banks, x, ids, w, act), a.reps, warmup=1) * 1e3
        tk = median_seconds(lambda: LayerJob(x, banks, 0, pairs_of(ids, w), "silu", act.alpha, act.limit,
                                             fmt=a.format).run().to(dtype), a.reps, warmup=1) * 1e3 if kernel else None
        cells = "- | -" if tk is None else f"{tk:.2f} | {tt / tk:.2f}"
        print(f"| {a.format} | {t} | {ids.numel()} | {'gathered' if gathered else 'loop'} | {tt:.2f} | {cells} |",
              flush=True)


if __name__ == "__main__":
    main()
