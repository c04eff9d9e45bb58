"""Misses read by the decode kernel itself over the link, against copying them first.

    python benchmarks/bench_host_reads.py                      # gpt-oss-20b layer, one token, top-4
    python benchmarks/bench_host_reads.py --format gguf:q4_k:q6_k --hidden 2048 --inter 768 --experts 128 \
        --topk 8 --act silu                                    # a qwen3-30b-a3b Q4_K_M layer

One decode token's MoE layer, M of its K experts not on the GPU, for M = 0, 1, K/2 and K, each
call on other experts (the host bank cycles, so nothing is served from the GPU's L2):
- `read`: `fused_moe_decode(host=)` reads those M experts from the pinned host bank (ids -1 - e);
- `copy`: the M experts are copied into slots (one copy per tensor of each expert, on the same
  stream), then the kernel reads every expert on the GPU; this is today's miss path without its
  host bookkeeping.
Both in CUDA graphs. Reports microseconds per call, the link rate each path achieves on the M
experts' bytes (time over M = 0's), and the pinned host -> device copy bandwidth of the run
(bench_offload.link_bandwidth: expert-sized copies).
"""

from __future__ import annotations

import argparse

import torch

from bench_fused_moe import DTYPES, graph_time
from bench_offload import link_bandwidth
from ferryman.layers.fused_moe_triton import fused_moe_decode
from ferryman.layers.moe_common import MoEActivation, host_tables
from ferryman.quant import get_format


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="mxfp4", help="an expert format: mxfp4, dense, gguf:q4_k:q6_k, ...")
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--inter", type=int, default=2880)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--act", default="swiglu_oai", choices=["swiglu_oai", "silu"])
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_reads needs a CUDA device")
    dtype, form, k, e = DTYPES[a.dtype], get_format(a.format), a.topk, a.experts
    bias = a.act == "swiglu_oai"
    host = {n: b.pin_memory() for n, b in form.random_banks(e, a.hidden, a.inter, bias, dtype,
                                                            torch.Generator().manual_seed(0)).items()}
    pool = {n: b.cuda() for n, b in host.items()}  # slot = expert id
    tables = host_tables(a.format, pool, host, torch.device("cuda"))
    x = torch.randn(1, a.hidden, device="cuda").to(dtype)
    w = torch.softmax(torch.randn(1, k, device="cuda"), -1)
    act = MoEActivation(a.act)
    per_expert = form.expert_bytes(a.hidden, a.inter, bias, dtype)
    calls = max(1, e // k)  # routings per timed round: each reads other experts
    routes = [torch.arange(c * k, (c + 1) * k, dtype=torch.int32) % e for c in range(calls)]
    bw = link_bandwidth(per_expert, torch.device("cuda"))  # expert-sized copies, as the copy path makes
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"pinned host -> device copies: {bw / 1e9:.1f} GB/s; {a.format} H={a.hidden} I={a.inter} E={e} K={k} "
          f"{a.dtype}: {per_expert / 1e6:.2f} MB per expert")
    base = None
    for m in sorted({0, 1, k // 2, k}):
        ids = [torch.where(torch.arange(k) < m, -1 - r, r).view(1, k).int().cuda() for r in routes]
        dev_ids = [r.view(1, k).cuda() for r in routes]

        def read(ids: list[torch.Tensor] = ids) -> None:
            for i in ids:
                fused_moe_decode(a.format, pool, x, i, w, act.kind, act.alpha, act.limit, host=tables)

        def copy(m: int = m) -> None:
            for r, i in zip(routes, dev_ids):
                for ex in r[:m].tolist():
                    for n, b in pool.items():
                        b[ex].copy_(host[n][ex], non_blocking=True)
                fused_moe_decode(a.format, pool, x, i, w, act.kind, act.alpha, act.limit)

        t_read, t_copy = graph_time(read, a.iters) / calls, graph_time(copy, a.iters) / calls
        base = t_read if m == 0 else base
        rates = ""
        if m and base is not None:
            moved = m * per_expert
            rates = (f"  link rate: read {moved / max(t_read - base, 1e-9) / 1e9:.1f} GB/s, "
                     f"copy {moved / max(t_copy - base, 1e-9) / 1e9:.1f} GB/s; read / copy time {t_read / t_copy:.2f}")
        print(f"M={m}: read {t_read * 1e6:8.1f} us  copy {t_copy * 1e6:8.1f} us{rates}")


if __name__ == "__main__":
    main()
