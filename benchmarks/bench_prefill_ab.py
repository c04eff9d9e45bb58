"""Offloaded prefill, variants in turn in one process: tokens/s and the ratio to the streaming limit.

    python benchmarks/bench_prefill_ab.py --target gpt-oss-120b:16GiB --prompt 8192 \
        --variant "" --variant prefetch=0 --variant policy=lru --settle 1 --reps 2

`--prompt 256,8192` runs each size in turn (a warm-up prompt of that size first).

Separate processes are a poor A/B on a fresh machine: the first pays Triton's compiles (the disk
cache serves the next), and the 120b load pins ~60 GB each time. Here one engine loads once, runs a
warm-up prompt, then goes through the variants in turn over fresh prompts (no prefix-cache hit).
A variant is a list of OPTION=VALUE settings of the offloaded experts ("" for the defaults):
prefetch=0|1 (the next layer's experts streamed ahead), policy=lru|lrfu; each
switch rebuilds the expert backend with them (ModelRunner.rebind_experts), so its cache starts
empty: --settle runs unmeasured prompts first. The streaming limit is the
prompt's chunks x the uncached experts' bytes / the measured link bandwidth: every chunk of a long
prompt routes to about every expert, and what is not cached has to cross the link once per chunk.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bench_offload import link_bandwidth, uncached_bytes  # noqa: E402

from ferryman import LLM, SamplingParams  # noqa: E402

OPTIONS = ("prefetch", "policy")


def prefill_s(llm: LLM, prompt: list[int]) -> float:
    """Seconds from submit to the first token of a 1-token request (its prefill)."""
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=[prompt], params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="gpt-oss-120b:16GiB",
                    help="MODEL:GPU_BUDGET (a preset name: dummy weights; a directory: its weights)")
    ap.add_argument("--expert-cache", help="expert slots (a count or a fraction such as 25%%) instead of the plan's")
    ap.add_argument("--prompt", default="8192", help="prompt tokens per run; a comma list runs each size in turn")
    ap.add_argument("--variant", action="append", required=True,
                    help='space-separated OPTION=VALUE settings ("" for the defaults); repeat for each variant')
    ap.add_argument("--reps", type=int, default=2, help="rounds over the variants")
    ap.add_argument("--settle", type=int, default=0,
                    help="unmeasured prompts after each switch (for variants that reshape the cache's contents)")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    variants = [dict(kv.split("=", 1) for kv in v.split()) for v in a.variant if all("=" in kv for kv in v.split())]
    if len(variants) != len(a.variant) or any(set(v) - set(OPTIONS) for v in variants):
        ap.error(f"each --variant is OPTION=VALUE settings ({', '.join(OPTIONS)}) separated by spaces, got {a.variant}")
    model, _, budget = a.target.partition(":")
    kw = {} if Path(model).is_dir() else {"load_format": "dummy"}
    if a.expert_cache:
        kw["expert_cache"] = a.expert_cache
    llm = LLM(model, gpu_memory=budget or None, max_num_seqs=1, max_model_len=a.max_model_len,
              moe_strategy="offload", progress=sys.stderr.isatty(), **kw)
    eng = llm.engine
    chunk, slots = eng.plan.request.max_num_batched_tokens, eng.stats()["experts"]["slots"]
    uncached = uncached_bytes(llm)
    bw = link_bandwidth(eng.plan.slot_bytes, eng.device)
    rows = []
    for size in (int(p) for p in a.prompt.split(",")):
        rows += _sweep(llm, variants, min(size, eng.max_model_len - 2), uncached, bw, a)
    if a.json:
        a.json.write_text(json.dumps({"target": a.target, "slots": slots, "chunk": chunk, "link_gb_s": bw / 1e9,
                                      "rows": rows}, indent=1))


def options(variant: dict[str, str]) -> dict:
    """rebind_experts' keyword arguments of a variant."""
    return {k: (v if k == "policy" else v not in ("0", "false", "off")) for k, v in variant.items()}


def _sweep(llm: LLM, variants: list[dict[str, str]], n: int, uncached: int, bw: float,
           a: argparse.Namespace) -> list[dict]:
    """Every variant over fresh n-token prompts, a.reps rounds; one row each (also printed)."""
    eng = llm.engine
    cfg, chunk = eng.cfg, eng.plan.request.max_num_batched_tokens
    slots = eng.stats()["experts"]["slots"]
    model, _, budget = a.target.partition(":")
    limit_s = -(-n // chunk) * uncached / bw  # seconds if the link streamed the uncached experts non-stop
    gen = torch.Generator().manual_seed(0)
    rand = lambda: torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    prefill_s(llm, rand())  # warm-up with the defaults: compiles, cuBLAS heuristics, a full cache
    print(f"{model} at {budget}: {slots} slots, chunk {chunk}, link {bw / 1e9:.1f} GB/s, {n}-token prompt, "
          f"streaming limit {n / limit_s:.0f} tok/s")
    print("| variant | round | ms | tok/s | of the streaming limit | GB copied | copy-stream s | compute waited s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows: list[dict] = []
    for rep in range(a.reps):
        for v in variants:
            eng.runner.rebind_experts(**options(v))
            for _ in range(a.settle):
                prefill_s(llm, rand())
            s0 = eng.stats()["experts"]
            secs = prefill_s(llm, rand())
            s1 = eng.stats()["experts"]
            row = {"variant": " ".join(f"{k}={x}" for k, x in v.items()) or "defaults", "prompt": n, "rep": rep,
                   "stream_limit_tok_s": n / limit_s, "tok_s": n / secs, "vs_stream": limit_s / secs,
                   "moved_gb": (s1["bytes_h2d"] - s0["bytes_h2d"]) / 1e9,
                   "stall_s": s1["stall_seconds"] - s0["stall_seconds"], "h2d_s": s1["h2d_seconds"] - s0["h2d_seconds"]}
            rows.append(row)
            print(f"| {row['variant']} | {rep} | {secs * 1e3:.1f} | {row['tok_s']:.0f} | {row['vs_stream']:.3f} | {row['moved_gb']:.1f} | "
                  f"{row['h2d_s']:.2f} | {row['stall_s']:.2f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
