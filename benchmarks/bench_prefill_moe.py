"""One MoE layer of a prefill step, every expert on the GPU: each path's time per call by token count.

    python benchmarks/bench_prefill_moe.py [--tokens 16,32,64,128,256,512,1024,2048,4096] [--shapes a,b]

Shapes: gpt-oss-20b (MXFP4, 32 experts, top-4, 2880 x 2880), qwen3-30b-a3b (128 experts, top-8,
2048 x 768) in bf16, int4 (g128, sym and asym), fp8 (128x128 blocks), nvfp4 and GGUF Q4_K_M (q4_k
gate/up, q6_k down), and qwen3-next (512 experts, top-10, 2048 x 512) in int4, fp8, nvfp4 and Q4_K_M;
random weights and routing (each token's top-k distinct). Paths:
- batched: groups of experts dequantised into bf16 scratch, then batched GEMMs;
- grouped: one Triton grouped GEMM per projection, packed weights decoded inside the kernel's tiles.
fused_moe takes the grouped GEMM for bf16 experts and for packed ones up to their family's
GROUPED_*_MAX_PAIRS (layers/fused_moe.py), the batched path above: the "default" column. Where
grouped / batched crosses 1 sets that limit (in pairs = tokens x top-k). GGUF experts take the
batched path at every size (decoding their blocks in the grouped GEMM's tiles measured slower at
every token count) and the grouped GEMM does not read them: their grouped columns read "-".
Each call is timed from launch to synchronize (host overhead included: prefill runs eagerly),
median of the iterations, after warm-up calls. The error column is each path's relative error
against the torch reference (fused_moe_reference) on the same inputs.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import median_seconds  # noqa: E402

from ferryman.layers.batched_moe import fused_moe_batched  # noqa: E402
from ferryman.layers.fused_moe import prefill_path  # noqa: E402
from ferryman.layers.grouped_moe_triton import GroupedConfig, grouped_moe  # noqa: E402
from ferryman.layers.moe_common import MoEActivation, grouped_reads  # noqa: E402
from ferryman.layers.moe_reference import fused_moe_reference  # noqa: E402
from ferryman.quant import Banks, get_format  # noqa: E402

SHAPES = {  # name: (format, experts, top_k, hidden, inter, bias, activation)
    "gpt-oss-20b": ("mxfp4", 32, 4, 2880, 2880, True, "swiglu_oai"),
    "qwen3-30b-a3b": ("dense", 128, 8, 2048, 768, False, "silu"),
    "qwen3-30b-a3b-int4": ("int4:g128:sym", 128, 8, 2048, 768, False, "silu"),
    "qwen3-30b-a3b-int4-asym": ("int4:g128:asym", 128, 8, 2048, 768, False, "silu"),
    "qwen3-30b-a3b-fp8": ("fp8:128x128", 128, 8, 2048, 768, False, "silu"),
    "qwen3-30b-a3b-nvfp4": ("nvfp4", 128, 8, 2048, 768, False, "silu"),
    "qwen3-30b-a3b-q4_k_m": ("gguf:q4_k:q6_k", 128, 8, 2048, 768, False, "silu"),
    "qwen3-next-int4": ("int4:g128:sym", 512, 10, 2048, 512, False, "silu"),
    "qwen3-next-fp8": ("fp8:128x128", 512, 10, 2048, 512, False, "silu"),
    "qwen3-next-nvfp4": ("nvfp4", 512, 10, 2048, 512, False, "silu"),
    "qwen3-next-q4_k_m": ("gguf:q4_k:q6_k", 512, 10, 2048, 512, False, "silu"),
}


def sweep(fmt: str, banks: Banks, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, act: MoEActivation,
          iters: int, err: Callable[[torch.Tensor], float]) -> None:
    """The grouped kernel's tile configurations at one token count: ms and error of each."""
    rows = []
    for bm, bn, bk, nw in itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (4,)):
        cfg = GroupedConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw)
        try:
            ms = median_seconds(lambda: grouped_moe(fmt, banks, x, ids, w, act, cfg=cfg), iters) * 1e3
            e = err(grouped_moe(fmt, banks, x, ids, w, act, cfg=cfg))
        except Exception as exc:  # a tile configuration that does not compile (registers, shared memory)
            print(f"  {cfg}: failed: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        rows.append((ms, cfg, e))
    for ms, cfg, e in sorted(rows, key=lambda r: r[0])[:8]:
        print(f"  {ms:8.3f} ms  err {e:.1e}  {cfg}")


def routing(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1).indices  # [T, K] distinct
    w = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=gen), -1)
    return ids.to(torch.int32), w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16,32,64,128,256,512,1024,2048,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", default="", help="token counts at which to also time the grouped kernel's tile "
                    "configurations (block_m x block_n x block_k, 4 warps), e.g. 128,1024")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill_moe needs a CUDA device")
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in a.shapes.split(","):
        fmt, experts, top_k, hidden, inter, bias, act_kind = SHAPES[name]
        form, act = get_format(fmt), MoEActivation(act_kind)
        banks = form.random_banks(experts, hidden, inter, bias, torch.bfloat16, gen, "cuda")
        print(f"\n{name}: {fmt}, {experts} experts, top-{top_k}, H {hidden}, I {inter}")
        print("| tokens | pairs | default | batched ms | grouped ms | grouped / batched | err batched | err grouped |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for t in (int(s) for s in a.tokens.split(",")):
            x = torch.randn(t, hidden, device="cuda", generator=gen).to(torch.bfloat16)
            ids, w = routing(t, experts, top_k, gen)
            ref = fused_moe_reference(form, banks, x, ids, w, act).float()

            def err(out: torch.Tensor) -> float:
                return ((out.float() - ref).norm() / ref.norm()).item()

            def batched() -> torch.Tensor:
                return fused_moe_batched(form, banks, x, ids, w, act)

            def grouped() -> torch.Tensor:
                return grouped_moe(fmt, banks, x, ids, w, act)

            tb = median_seconds(batched, a.iters)
            path = prefill_path(fmt, t * top_k)
            if grouped_reads(fmt):
                tg = median_seconds(grouped, a.iters)
                cols = f"{tg * 1e3:.3f} | {tg / tb:.2f} | {err(batched()):.1e} | {err(grouped()):.1e}"
            else:
                cols = f"- | - | {err(batched()):.1e} | -"
            print(f"| {t} | {t * top_k} | {path} | {tb * 1e3:.3f} | {cols} |", flush=True)
            if str(t) in a.sweep.split(",") and grouped_reads(fmt):
                sweep(fmt, banks, x, ids, w, act, a.iters, err)
            del x, ids, w, ref
        del banks
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
