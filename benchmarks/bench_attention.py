"""Paged attention speed on CUDA at gpt-oss-20b shapes (Hq=64, Hkv=8, D=64, bf16).

Decode: batch B, context C, one query token each; reports GPU time per call (eager and inside
a CUDA graph, as the engine runs decode) and achieved GB/s over the kv bytes it must read.
Prefill: one sequence of P tokens from an empty cache; reports time and TFLOP/s over the
visible (query, key) pairs, next to torch's SDPA (flash) on the same dense problem.

    python benchmarks/bench_attention.py [--ctx 4096] [--prefill 4096] [--batch 1]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from ferryman.layers.paged_attention import AttnMetadata, paged_attention

HQ, HKV, D = 64, 8, 64
DTYPE = torch.bfloat16
SCALE = D**-0.5
GRAPH_CALLS = 50  # calls captured in one graph; its replay time / GRAPH_CALLS = time per call


Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttnMetadata]


def make_case(batch: int, ctx: int, qlen: int, block_size: int) -> Case:
    """batch sequences of ctx kv (qlen of them new) in shuffled blocks -> q, k_cache, v_cache, meta."""
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, HKV, D, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device="cuda").int()
    meta = AttnMetadata(
        query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32) * qlen,
        seq_lens=torch.full((batch,), ctx, device="cuda", dtype=torch.int32),
        block_tables=perm.view(batch, blocks_per_seq),
        slot_mapping=torch.zeros(batch * qlen, device="cuda", dtype=torch.int64),  # unused here
        max_query_len=qlen,
        max_seq_len=ctx,
    )
    q = torch.randn(batch * qlen, HQ, D, device="cuda", dtype=DTYPE)
    return q, k_cache, v_cache, meta


def graph_time_us(fn) -> float:
    """Mean GPU time of fn when replayed from a CUDA graph (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=200)
    return ms * 1e3 / GRAPH_CALLS


def visible_pairs(num_q: int, ctx: int, window: int | None) -> int:
    """(query, key) pairs a causal (windowed) attention of the last num_q queries computes."""
    first = ctx - num_q
    return sum(min(pos + 1, window or pos + 1) for pos in range(first, ctx))


def bench_decode(batch: int, ctx: int, block_size: int) -> None:
    q, k_cache, v_cache, meta = make_case(batch, ctx, 1, block_size)
    sinks = torch.randn(HQ, device="cuda")
    for window in (None, 128):
        fn = lambda: paged_attention(q, k_cache, v_cache, meta, SCALE, window, sinks)  # noqa: E731
        eager_us = triton.testing.do_bench(fn, warmup=25, rep=200) * 1e3
        graph_us = graph_time_us(fn)
        kv_bytes = 2 * batch * min(ctx, window or ctx) * HKV * D * k_cache.element_size()
        print(
            f"decode  B={batch} ctx={ctx} window={window}: {graph_us:7.2f} us/call in a CUDA graph "
            f"({kv_bytes / graph_us / 1e3:7.1f} GB/s of kv), {eager_us:7.2f} us eager (host launch bound)"
        )


def bench_prefill(num_tokens: int, block_size: int) -> None:
    q, k_cache, v_cache, meta = make_case(1, num_tokens, num_tokens, block_size)
    sinks = torch.randn(HQ, device="cuda")
    for window in (None, 128):
        fn = lambda: paged_attention(q, k_cache, v_cache, meta, SCALE, window, sinks)  # noqa: E731
        ms = triton.testing.do_bench(fn, warmup=10, rep=200)
        flops = 4 * HQ * D * visible_pairs(num_tokens, num_tokens, window)
        print(f"prefill T={num_tokens} window={window}: {ms * 1e3:8.1f} us, {flops / ms / 1e9:6.1f} TFLOP/s")
    # torch SDPA on the same problem as dense tensors (flash kernel, causal, no window/sinks)
    qd = q.transpose(0, 1)[None]  # [1, Hq, T, D]
    kd = torch.randn(1, HKV, num_tokens, D, device="cuda", dtype=DTYPE)
    vd = torch.randn_like(kd)
    sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)  # noqa: E731
    ms = triton.testing.do_bench(sdpa, warmup=10, rep=200)
    flops = 4 * HQ * D * visible_pairs(num_tokens, num_tokens, None)
    tflops = flops / ms / 1e9
    print(f"prefill T={num_tokens} torch SDPA causal (reference point): {ms * 1e3:8.1f} us, {tflops:6.1f} TFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=4096, help="decode context length")
    parser.add_argument("--batch", type=int, default=1, help="decode batch size")
    parser.add_argument("--prefill", type=int, default=4096, help="prefill chunk tokens")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA device")
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"shapes: Hq={HQ} Hkv={HKV} D={D} {DTYPE} block_size={args.block_size}")
    bench_decode(args.batch, args.ctx, args.block_size)
    bench_prefill(args.prefill, args.block_size)


if __name__ == "__main__":
    main()
