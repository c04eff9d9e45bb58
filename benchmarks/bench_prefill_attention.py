"""A long prompt's full-attention prefill at gpt-oss shapes (Hq 64, Hkv 8, D 64, bf16, sinks), chunk by
chunk as layer-major prefill runs it: the paged Triton kernel against torch's flash / cuDNN attention
on dense K/V, with the sinks added through the log-sum-exp the kernels return.

Each chunk's queries see every earlier key and their own chunk causally; the dense path computes
the two parts apart (the earlier keys without a mask, the chunk with the square causal mask, so
no mask alignment question arises) and merges them by their log-sum-exps, the sink entering the
softmax's denominator only (`merge` of layers/paged_attention_torch.py, the CPU's path).

At 16k tokens the 12 full-attention layers' prefill is about 26 TFLOP, 90 ms of a 0.64 s time to
first token at the paged kernel's ~290 TFLOP/s (docs/benchmarks.md, issue 25): what a faster kernel
saves there and at 32k is what this measures. Each path's output is compared with the paged
kernel's before it is timed.

    python benchmarks/bench_prefill_attention.py [--lengths 16384,32768] [--chunk 4096]
    python benchmarks/bench_prefill_attention.py --check     # the merge against the torch reference, CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ferryman.layers.paged_attention import AttnMetadata, paged_attention, paged_attention_reference  # noqa: E402
from ferryman.layers.paged_attention_torch import merge  # noqa: E402
from ferryman.layers.paged_attention_triton import paged_attention_triton  # noqa: E402

HQ, HKV, D = 64, 8, 64
# the paged kernel's prefill tile is (128, 64, 8 warps, 2 stages): larger q tiles, kv blocks, deeper pipelines
TILES = "128:64:8:3,128:128:8:2,128:128:8:3,256:64:8:2,256:64:8:3,256:128:8:2,256:64:16:2,128:32:4:3"
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]


def flash_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [1, Hq, L, D], lse [1, Hq, L] fp32) of torch's flash kernel; k, v: [1, Hkv, S, D] (grouped
    heads where the op takes them, else repeated, which the timing then includes)."""
    try:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    except RuntimeError:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def cudnn_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The cuDNN op wants equal head counts: without a mask each kv head's G query heads are stacked as
    rows ([1, Hkv, G x Q, D], k and v read once); the causal block repeats k and v (its causal mask is
    aligned top-left, right for the square block only)."""
    rep, (_, hq, n, d) = q.shape[1] // k.shape[1], q.shape
    if not causal:
        qf = q.contiguous().reshape(1, k.shape[1], rep * n, d)
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(qf, k, v, None, True, 0.0, False, False, scale=scale)
        return out[0].reshape(1, hq, n, d), out[1].reshape(1, hq, n)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q.shape[:3])


def flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out[0], out[1]


def dense_chunk(attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, sinks: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Queries q [T, Hq, D] at positions start .. start + T over keys k, v [start + T, Hkv, D], with
    sinks [Hq] -> [T, Hq, D]."""
    t = q.shape[0]
    qh = q.transpose(0, 1)[None]  # [1, Hq, T, D]
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, S, D]
    out_own, lse_own = attend(qh, kh[:, :, start:], vh[:, :, start:], True, scale)
    parts = [(out_own.float(), lse_own.float())]
    if start > 0:
        out_prev, lse_prev = attend(qh, kh[:, :, :start], vh[:, :, :start], False, scale)
        parts.append((out_prev.float(), lse_prev.float()))
    out = merge(parts, sinks)  # [1, Hq, T, D]
    return out[0].transpose(0, 1).to(q.dtype)[:t]


def paged_case(k: torch.Tensor, v: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [S, Hkv, D] in blocks of `block` in a shuffled order -> (k_cache, v_cache, block table)."""
    s = k.shape[0]
    n = -(-s // block)
    perm = torch.randperm(n, device=k.device)
    kc = torch.zeros(n, block, HKV, D, dtype=k.dtype, device=k.device)
    vc = torch.zeros_like(kc)
    pad = n * block - s
    kc[perm] = torch.cat([k, k.new_zeros(pad, HKV, D)]).view(n, block, HKV, D)
    vc[perm] = torch.cat([v, v.new_zeros(pad, HKV, D)]).view(n, block, HKV, D)
    return kc, vc, perm.int()[None]


def meta_of(start: int, t: int, table: torch.Tensor) -> AttnMetadata:
    dev = table.device
    return AttnMetadata(query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
                        seq_lens=torch.tensor([start + t], dtype=torch.int32, device=dev), block_tables=table,
                        slot_mapping=torch.zeros(t, dtype=torch.int64, device=dev), max_query_len=t,
                        max_seq_len=start + t)


def check_cpu() -> None:
    """The merge with flash_cpu against the torch reference, small shapes, fp32."""
    torch.manual_seed(0)
    h, hkv, d, block = 4, 2, 16, 8
    global HQ, HKV, D
    HQ, HKV, D = h, hkv, d
    s, chunk = 40, 16
    k, v = torch.randn(s, hkv, d), torch.randn(s, hkv, d)
    q = torch.randn(s, h, d)
    sinks = torch.randn(h)
    kc, vc, table = paged_case(k, v, block)
    for start in range(0, s, chunk):
        t = min(chunk, s - start)
        want = paged_attention_reference(q[start:start + t], kc, vc, meta_of(start, t, table), 0.25, None, sinks)
        got = dense_chunk(flash_cpu, q[start:start + t], k[:start + t], v[:start + t], start, sinks, 0.25)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    print("the dense chunks with sinks match the reference")


def time_ms(fn: Callable[[], object]) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def bench(length: int, chunk: int, block: int, tiles: list[tuple[int, int, int, int]]) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    k = torch.randn(length, HKV, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    q = torch.randn(length, HQ, D, device=dev, dtype=dt)
    sinks = torch.randn(HQ, device=dev)
    kc, vc, table = paged_case(k, v, block)
    scale = D**-0.5
    starts = list(range(0, length, chunk))
    metas = [meta_of(s, min(chunk, length - s), table) for s in starts]
    paged = [paged_attention(q[s:s + m.max_query_len], kc, vc, m, scale, None, sinks) for s, m in zip(starts, metas)]
    flops = 4 * HQ * D * length * (length + 1) / 2
    t_paged = time_ms(lambda: [paged_attention(q[s:s + m.max_query_len], kc, vc, m, scale, None, sinks)
                               for s, m in zip(starts, metas)])
    print(f"T={length} chunks of {chunk}: paged Triton {t_paged:7.2f} ms ({flops / t_paged / 1e9:5.0f} TFLOP/s)")
    for tile in tiles:
        run = lambda: [paged_attention_triton(q[s:s + m.max_query_len], kc, vc, m, scale, None, sinks,  # noqa: E731
                                              tile=tile) for s, m in zip(starts, metas)]  # noqa: B023
        try:
            err = max(float((g.float() - p.float()).abs().max()) for g, p in zip(run(), paged))
            t = time_ms(run)
        except Exception as e:  # noqa: BLE001 (a tile Triton cannot build: out of shared memory, registers)
            print(f"  tile {tile}: {type(e).__name__} {str(e).splitlines()[0][:100]}")
            continue
        print(f"  tile (BLOCK_M, BLOCK_N, warps, stages) {tile}: {t:7.2f} ms ({flops / t / 1e9:5.0f} TFLOP/s), "
              f"{t_paged / t:4.2f}x default; max |diff| {err:.3g}")
    for name, attend in (("flash", flash_cuda), ("cuDNN", cudnn_cuda)):
        try:
            got = [dense_chunk(attend, q[s:s + m.max_query_len], k[:s + m.max_query_len], v[:s + m.max_query_len], s,
                               sinks, scale) for s, m in zip(starts, metas)]
        except RuntimeError as e:
            print(f"  {name}: not available here ({str(e).splitlines()[0][:120]})")
            continue
        err = max(float((g.float() - p.float()).abs().max()) for g, p in zip(got, paged))
        t = time_ms(lambda: [dense_chunk(attend, q[s:s + m.max_query_len], k[:s + m.max_query_len],  # noqa: B023
                                         v[:s + m.max_query_len], s, sinks, scale) for s, m in zip(starts, metas)])
        print(f"  {name} + sinks by lse: {t:7.2f} ms ({flops / t / 1e9:5.0f} TFLOP/s), {t_paged / t:4.2f}x paged; "
              f"max |diff| {err:.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="16384,32768", help="prompt lengths (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=4096, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default: %(default)s)")
    p.add_argument("--tiles", default=TILES, help="paged kernel tiles to time beside the default, "
                   "BLOCK_M:BLOCK_N:warps:stages comma-separated; '' for none (default: %(default)s)")
    p.add_argument("--check", action="store_true", help="check the merge on the CPU, then exit")
    a = p.parse_args()
    if a.check:
        check_cpu()
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill_attention needs a CUDA device (or --check)")
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}; Hq {HQ}, Hkv {HKV}, D {D}, bf16")
    for length in (int(x) for x in a.lengths.split(",")):
        bench(length, a.chunk, a.block_size, [tuple(int(x) for x in t.split(":")) for t in a.tiles.split(",") if t])


if __name__ == "__main__":
    main()
