"""Decode speed of the Triton fused-MoE kernels against the GPU's own copy bandwidth.

    python benchmarks/bench_fused_moe.py                 # gpt-oss-20b layer, batch 1, top-4
    python benchmarks/bench_fused_moe.py --format gguf:q4_k:q6_k --hidden 2048 --inter 768 --experts 128 \
        --topk 8 --act silu                              # a qwen3-30b-a3b Q4_K_M layer (no biases)

Reports the GPU, the device-to-device copy bandwidth measured in the same run, the time of one
fused_moe decode call (eager and replayed from a CUDA graph), and the GB/s of expert bytes read.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from ferryman.layers.fused_moe_triton import BLOCK_K, BLOCK_N, NUM_WARPS, fused_moe_decode
from ferryman.layers.moe_common import MoEActivation
from ferryman.layers.moe_reference import fused_moe_reference
from ferryman.quant import get_format

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_cuda(fn: Callable[[], object], iters: int, warmup: int = 5) -> float:
    """Mean seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (each copy reads and writes nbytes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / time_cuda(lambda: dst.copy_(src), iters=20)


def graph_time(fn: Callable[[], object], iters: int) -> float:
    """Seconds per replay of `fn` captured in a CUDA graph (also proves it is capturable)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, iters)


def routing_sets(n_sets: int, tokens: int, topk: int, experts: int, gen: torch.Generator) -> list[torch.Tensor]:
    """n_sets [T, K] int32 id tensors walking through one permutation of the experts, so that
    consecutive calls read other experts and cannot be served from the L2 cache (60 MB on H200)."""
    perm = torch.randperm(experts, device="cuda", generator=gen)
    step = tokens * topk
    pos = torch.arange(n_sets * step, device="cuda").view(n_sets, tokens, topk) % experts
    return [perm[p].to(torch.int32) for p in pos]  # K <= E keeps a token's experts distinct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="mxfp4", help="dense, mxfp4 or gguf:<w13_type>:<w2_type>")
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--inter", type=int, default=2880)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--act", default="swiglu_oai", choices=["swiglu_oai", "silu"])
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused_moe needs a CUDA device")

    dtype, fmt = DTYPES[args.dtype], get_format(args.format)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bias = args.act == "swiglu_oai"  # gpt-oss has expert biases, silu models none
    banks = fmt.random_banks(args.experts, args.hidden, args.inter, bias, dtype, gen, "cuda")
    x = torch.randn(args.tokens, args.hidden, device="cuda", generator=gen).to(dtype)
    n_sets = max(1, args.experts // (args.topk * args.tokens))
    id_sets = routing_sets(n_sets, args.tokens, args.topk, args.experts, gen)
    topk_w = torch.softmax(torch.randn(args.tokens, args.topk, device="cuda", generator=gen), -1)
    act = MoEActivation(args.act)
    per_expert = fmt.expert_bytes(args.hidden, args.inter, bias, dtype)
    read = sum(int(torch.unique(ids).numel()) for ids in id_sets) * per_expert / n_sets  # per call

    bw = copy_bandwidth()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"copy bandwidth (d2d, read+write): {bw / 1e9:.0f} GB/s")
    print(f"shape: {args.format} H={args.hidden} I={args.inter} E={args.experts} K={args.topk} "
          f"T={args.tokens} {args.dtype}; {read / per_expert:.1f} experts = {read / 1e6:.2f} MB read per call, "
          f"cycling over {n_sets} routings")

    refs = [fused_moe_reference(fmt, banks, x, ids, topk_w, act).float() for ids in id_sets]

    def call() -> list[torch.Tensor]:
        return [fused_moe_decode(args.format, banks, x, ids, topk_w, act.kind, act.alpha, act.limit) for ids in id_sets]

    err = max(((o.float() - r).norm() / r.norm()).item() for o, r in zip(call(), refs))
    eager = time_cuda(call, args.iters) / n_sets
    graph = graph_time(call, args.iters) / n_sets
    print(f"tiles block_n {BLOCK_N} block_k {BLOCK_K} warps {NUM_WARPS}: eager {eager * 1e6:.1f} us  "
          f"graph {graph * 1e6:.1f} us  {read / graph / 1e9:.0f} GB/s = {read / graph / bw:.1%} of copy  "
          f"rel.err {err:.1e}")


if __name__ == "__main__":
    main()
