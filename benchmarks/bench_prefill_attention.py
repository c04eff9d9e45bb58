"""A long prompt's full-attention prefill at gpt-oss shapes (Hq 64, Hkv 8, D 64, bf16, sinks), chunk by
chunk as layer-major prefill runs it: the paged Triton kernel against the engine's path for a long
chunk (`paged_attention`: torch's flash kernel on the keys gathered from the blocks,
layers/paged_attention_torch.py), and flash / cuDNN on keys already dense.

Each chunk's queries see every earlier key and their own chunk causally: one causal call whose mask
aligns the queries with the last keys, then each row rescaled by its log-sum-exp, the sink entering
the softmax's denominator only (`attend_cuda` of layers/paged_attention_torch.py).

At 16k tokens the 12 full-attention layers' prefill is about 26 TFLOP, 90 ms of a 0.64 s time to
first token at the paged kernel's ~290 TFLOP/s (docs/benchmarks.md, issue 25): what a faster kernel
saves there and at 32k is what this measures. Each path's output is compared with the paged
kernel's before it is timed.

    python benchmarks/bench_prefill_attention.py [--lengths 16384,32768] [--chunk 4096]
    python benchmarks/bench_prefill_attention.py --check     # the dense path against the torch reference, CPU
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
from ferryman.layers.paged_attention_torch import attend_cuda, flash_cuda  # noqa: E402
from ferryman.layers.paged_attention_triton import paged_attention_triton  # noqa: E402

HQ, HKV, D = 64, 8, 64


def cudnn_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's attention in attend_cuda's `flash` place (its causal alignment is what the printed
    difference from the paged kernel shows); the kv heads repeated: the op wants equal counts."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q.shape[:3])


def flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA flash's contract on the CPU: grouped kv heads, causal aligned with the last keys."""
    rep, n, length = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mask = torch.zeros(n, length).masked_fill(torch.ones(n, length, dtype=torch.bool).triu(length - n + 1),
                                              float("-inf")) if causal else None
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    return out[0], out[1]


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
    """attend_cuda with flash_cpu against the torch reference, small shapes, fp32."""
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
        got = attend_cuda(q[start:start + t], k[:start + t], v[:start + t], 0.25, sinks, flash_cpu)
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


def bench(length: int, chunk: int, block: int) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    k = torch.randn(length, HKV, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    q = torch.randn(length, HQ, D, device=dev, dtype=dt)
    sinks = torch.randn(HQ, device=dev)
    kc, vc, table = paged_case(k, v, block)
    scale = D**-0.5
    starts = list(range(0, length, chunk))
    metas = [meta_of(s, min(chunk, length - s), table) for s in starts]
    paged = [paged_attention_triton(q[s:s + m.max_query_len], kc, vc, m, scale, None, sinks)
             for s, m in zip(starts, metas)]
    flops = 4 * HQ * D * length * (length + 1) / 2
    t_paged = time_ms(lambda: [paged_attention_triton(q[s:s + m.max_query_len], kc, vc, m, scale, None, sinks)
                               for s, m in zip(starts, metas)])
    print(f"T={length} chunks of {chunk}: paged Triton {t_paged:7.2f} ms ({flops / t_paged / 1e9:5.0f} TFLOP/s)")
    paths: dict[str, Callable[[int, AttnMetadata], torch.Tensor]] = {
        # what the engine runs: paged_attention's dispatch, the keys gathered from the blocks
        "engine (flash, keys gathered)": lambda s, m: paged_attention(q[s:s + m.max_query_len], kc, vc, m, scale,
                                                                      None, sinks),
        "flash on dense keys": lambda s, m: attend_cuda(q[s:s + m.max_query_len], k[:s + m.max_query_len],
                                                        v[:s + m.max_query_len], scale, sinks, flash_cuda),
        "cuDNN on dense keys": lambda s, m: attend_cuda(q[s:s + m.max_query_len], k[:s + m.max_query_len],
                                                        v[:s + m.max_query_len], scale, sinks, cudnn_cuda),
    }
    for name, path in paths.items():
        try:
            got = [path(s, m) for s, m in zip(starts, metas)]
        except RuntimeError as e:
            print(f"  {name}: not available here ({str(e).splitlines()[0][:120]})")
            continue
        err = max(float((g.float() - p.float()).abs().max()) for g, p in zip(got, paged))
        t = time_ms(lambda: [path(s, m) for s, m in zip(starts, metas)])  # noqa: B023
        print(f"  {name}, sinks by lse: {t:7.2f} ms ({flops / t / 1e9:5.0f} TFLOP/s), {t_paged / t:4.2f}x paged; "
              f"max |diff| {err:.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="16384,32768", help="prompt lengths (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=4096, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default: %(default)s)")
    p.add_argument("--check", action="store_true", help="check the dense path on the CPU, then exit")
    a = p.parse_args()
    if a.check:
        check_cpu()
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill_attention needs a CUDA device (or --check)")
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}; Hq {HQ}, Hkv {HKV}, D {D}, bf16")
    for length in (int(x) for x in a.lengths.split(",")):
        bench(length, a.chunk, a.block_size)


if __name__ == "__main__":
    main()
