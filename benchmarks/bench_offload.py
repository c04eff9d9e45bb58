"""Offloaded-expert serving under a VRAM budget: decode tok/s, TTFT, prefill, and the link limits.

    python benchmarks/bench_offload.py                       # the three GPU targets below
    python benchmarks/bench_offload.py --target gpt-oss-20b:8GiB --decode-tokens 128
    python benchmarks/bench_offload.py --target qwen3-30b-a3b:8GiB:fp8     # dummy experts in FP8 (or nvfp4)
    python benchmarks/bench_offload.py --target demo:cpu --device cpu --expert-cache 10%   # smoke test

Targets (dummy weights of the real shapes, one request at a time, greedy):
  gpt-oss-120b at 16 GiB, gpt-oss-20b at 8 GiB, qwen3-30b-a3b at 8 GiB.

Per target:
- link bandwidth: pinned host -> device copies of one expert row at a time (what a miss moves);
- decode: 128-token prompt, then --decode-tokens tokens; tok/s, hit rate, misses per token, and
  the link limit bw / (bytes copied per token: misses, and prefetched experts right or wrong):
  measured / limit says how close the copies run to the link (1.0 = every byte at full link
  speed, nothing else costs); also against the bytes needed (the copies less those of guessed
  experts never used), which wrong guesses cannot inflate;
- TTFT of a 4k prompt (--ttft-prompt);
- 8k prefill tok/s (--prefill-prompt) against the streaming limit chunk x bw / (expert bytes not cached): each prefill
  chunk must bring every uncached expert once.
A 512-token request with 8 decode steps runs first, unmeasured, so no figure includes a kernel compile
or graph capture. Decode uses the per-layer CUDA graphs of offloaded models unless --eager. Dummy weights route like
random text: no locality, so hit rates are a floor (bench_cache_policies.py replays real routing).
On CUDA each row also keeps the peak allocated memory against the plan's total and activation
estimate, and the allocator's retries (a plan that under-estimates shows as retries or an OOM).
Print a markdown table; --json keeps everything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ferryman import LLM, SamplingParams  # noqa: E402
from ferryman.engine.warm_up import warm_up  # noqa: E402
from ferryman.cli_bench import calibrated_rates  # noqa: E402
from ferryman.plan_report import Load, predict  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fewer_layers import fewer_layers  # noqa: E402
from host_usage import HostUsage  # noqa: E402

TARGETS = ("gpt-oss-120b:16GiB", "gpt-oss-20b:8GiB", "qwen3-30b-a3b:8GiB")


def link_bandwidth(row_bytes: int, device: torch.device, copies: int = 64) -> float:
    """Bytes/s of `copies` back-to-back host -> device copies of distinct expert rows (pinned on
    CUDA) into one device row: the engine's budget leaves no room for more."""
    cuda = device.type == "cuda"
    src = torch.empty((copies, row_bytes), dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(row_bytes, dtype=torch.uint8, device=device)
    for _ in range(2):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for i in range(copies):
            dst.copy_(src[i], non_blocking=True)
        if cuda:
            torch.cuda.synchronize(device)
        spent = time.perf_counter() - t0
    return copies * row_bytes / spent


def uncached_bytes(llm: LLM) -> int:
    """Bytes of the routed experts that have no slot: what each chunk of a long prompt, touching
    about every expert, must bring over the link (the streaming limit's numerator)."""
    eng = llm.engine
    total = len(eng.cfg.moe_layers) * eng.cfg.num_experts
    return max(0, total - eng.stats()["experts"].get("slots", total)) * eng.plan.slot_bytes


COUNTERS = ("hits", "misses", "bytes_h2d", "copies_h2d", "h2d_seconds", "stall_seconds",
            "prefetch_fetched", "prefetch_hits", "cpu_computed", "link_read_bytes")


def generate(llm: LLM, prompt: list[int], tokens: int) -> dict:
    """One request, streamed; returns its metrics and the expert-counter deltas of its decode steps
    alone (from the first token on: the prompt's prefill is not counted)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    before = None
    for _ in llm.stream(prompt, params):
        if before is None:  # the first token: prefill done
            before = llm.stats()["experts"]
    after = llm.stats()["experts"]
    out = llm.last_output
    delta = {k: after[k] - before.get(k, 0) for k in COUNTERS if k in after}
    return {"ttft_s": out.metrics.ttft_s, "decode_tok_s": out.metrics.decode_tokens_per_s, **delta}


def run_target(model: str, budget: str, a: argparse.Namespace, quantization: str = "none") -> dict:
    demo = model == "demo"
    # weights from files (a .gguf file or a model folder), not a preset's dummy weights
    files = demo or model.endswith(".gguf") or Path(model).is_dir()
    kw = dict(device=a.device, dtype=a.dtype, max_num_seqs=1, max_model_len=a.max_model_len, enforce_eager=a.eager,
              max_num_batched_tokens=a.chunk, moe_strategy=a.moe_strategy, progress=sys.stderr.isatty(),
              decode_misses=a.decode_misses)
    if not files:
        kw["load_format"] = "dummy"
        kw["quantization"] = quantization
    if budget != "cpu":
        kw["gpu_memory"] = budget
    if a.expert_cache:
        kw["expert_cache"] = a.expert_cache
    if a.no_decode_prefetch:
        kw["decode_prefetch"] = False
    source = fewer_layers(model, a.layers) if a.layers and not files else model
    t0 = time.perf_counter()
    llm = LLM(None if demo else source, **kw)
    load_s = time.perf_counter() - t0
    eng = llm.engine
    if eng.plan.strategy == "offload" and (a.policy or a.no_prefetch):
        eng.runner.rebind_experts(policy=a.policy, prefetch=not a.no_prefetch, decode_prefetch=not a.no_decode_prefetch)
    experts = eng.stats()["experts"]
    chunk = eng.plan.request.max_num_batched_tokens
    slot_bytes = eng.plan.slot_bytes
    bw = link_bandwidth(slot_bytes, eng.device)
    gen = torch.Generator().manual_seed(0)
    vocab = eng.cfg.vocab_size
    rand = lambda n: torch.randint(1, vocab, (n,), generator=gen).tolist()  # noqa: E731
    # warm-up: `ferryman serve`'s (every step shape a server meets: Triton compiles), then one
    # request as before: layer-graph capture, cuBLAS heuristics
    warm = warm_up(eng)
    print(f"warm-up: {warm.seconds:.1f} s, {warm.steps} steps, the slowest {warm.slowest_s:.2f} s", file=sys.stderr)
    generate(llm, rand(512), 8 + a.settle_tokens)  # settle: auto's trials decide before the measured decode
    cpus = os.sched_getaffinity(0) if a.main_cpu is not None else None
    if a.main_cpu is not None:  # after the warm-up: threads started before keep their own CPUs
        os.sched_setaffinity(0, {a.main_cpu})
    with HostUsage() as host:  # slow runs of one-sequence decode spent their time on the host
        dec = generate(llm, rand(128), a.decode_tokens)
    if cpus is not None:  # the TTFT and prefill runs as without the flag
        os.sched_setaffinity(0, cpus)
    ttft_len = min(a.ttft_prompt, eng.max_model_len - 2)  # the demo model's context is 2048
    pre_len = min(a.prefill_prompt, eng.max_model_len - 2)
    ttft = generate(llm, rand(ttft_len), 1)["ttft_s"] if ttft_len > 0 else None
    pre = generate(llm, rand(pre_len), 1) if pre_len > 0 else {"ttft_s": None}
    cfg = eng.cfg
    end = eng.stats()  # after every phase: auto's split trial may have ruled
    total_experts = len(cfg.moe_layers) * cfg.num_experts
    uncached = uncached_bytes(llm)
    decode_steps = max(1, a.decode_tokens - 1)  # the counters start after the first token
    misses_per_token = dec.get("misses", 0) / decode_steps
    # every byte that crossed the link per token: copies (misses, prefetched ones right or wrong) and
    # the decode kernel's reads of uncached experts in link steps
    moved_per_token = (dec.get("bytes_h2d", 0) + dec.get("link_read_bytes", 0)) / decode_steps
    wasted = max(0, dec.get("prefetch_fetched", 0) - dec.get("prefetch_hits", 0)) * slot_bytes / decode_steps
    needed_per_token = moved_per_token - wasted  # the copies of wrong guesses left out
    row = {
        "model": model, "experts": cfg.expert_format, "layers": cfg.num_layers, "budget": budget, "strategy": eng.plan.strategy, "load_s": load_s,
        "slots": experts.get("slots"), "cache_fraction": experts.get("slots", total_experts) / total_experts,
        "link_gb_s": bw / 1e9, "decode_tok_s": dec["decode_tok_s"],
        "decode_ms_per_layer": 1e3 / dec["decode_tok_s"] / cfg.num_layers if dec["decode_tok_s"] else None,
        "decode_hit_rate": dec.get("hits", 0) / max(1, dec.get("hits", 0) + dec.get("misses", 0)),
        "misses_per_token": misses_per_token,
        "decode_link_limit": bw / moved_per_token if moved_per_token else None,
        "decode_needed_limit": bw / needed_per_token if needed_per_token > 0 else None,
        "wasted_mib_per_token": wasted / 2**20,
        "no_hit_limit": bw / (len(cfg.moe_layers) * cfg.top_k * slot_bytes),
        "ttft_prompt": ttft_len, "ttft_s": ttft, "prefill_prompt": pre_len, "prefill_tok_s": pre_len / pre["ttft_s"] if pre["ttft_s"] else None,
        "chunk": chunk,
        "prefill_stream_limit": chunk * bw / uncached if uncached and pre_len > 0 else None,
        "cuda_graph_mode": end["cuda_graph_mode"],
        "moe_strategy": a.moe_strategy, "decode_misses": eng.plan.decode_misses, "cpu_layers": eng.plan.cpu_layers, "cpu_computed_per_token": dec.get("cpu_computed", 0) / decode_steps,
        "hybrid": end["experts"].get("hybrid"), "split_trial": end["experts"].get("split_trial"),
        "link_trial": end.get("link_trial"),
        "prefetch_layers": _prefetch_layers(end["experts"]),
        "stall_s_decode": dec.get("stall_seconds"), "h2d_s_decode": dec.get("h2d_seconds"),
        "h2d_mib_per_token": dec.get("bytes_h2d", 0) / decode_steps / 2**20,
        "link_read_mib_per_token": dec.get("link_read_bytes", 0) / decode_steps / 2**20,  # decode_misses link
        "copies_per_token": dec.get("copies_h2d", 0) / decode_steps,
        "prefetched_per_token": dec.get("prefetch_fetched", 0) / decode_steps,
        "prefetch_precision": (dec["prefetch_hits"] / dec["prefetch_fetched"]) if dec.get("prefetch_fetched") else None,
        **host.figures("decode"), "main_cpu": a.main_cpu,
    }
    if eng.plan.strategy == "offload":  # `ferryman plan`'s prediction at the measured link rate
        rates = calibrated_rates(eng.cfg, eng.plan.request.dtype, link=(bw, "measured"))
        row["pred_decode_tok_s"] = predict(eng.plan, rates, Load(1, 128, a.decode_tokens, 0)).decode_tok_s
        row["pred_ttft_s"] = predict(eng.plan, rates, Load(1, max(1, ttft_len), 1, 0)).ttft_s if ttft else None
    if torch.cuda.is_available() and eng.device.type == "cuda":  # is the plan's activation estimate honest?
        row["peak_gib"] = torch.cuda.max_memory_allocated(eng.device) / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(eng.device) / 2**30  # what the cap limits
        row["plan_gib"] = eng.plan.total_bytes / 2**30
        row["plan_activation_gib"] = eng.plan.activation_bytes / 2**30
        row["alloc_retries"] = torch.cuda.memory_stats(eng.device).get("num_alloc_retries", 0)
    if row["decode_link_limit"] and row["decode_tok_s"]:
        row["decode_vs_link"] = row["decode_tok_s"] / row["decode_link_limit"]
    if row["decode_needed_limit"] and row["decode_tok_s"]:
        row["decode_vs_needed"] = row["decode_tok_s"] / row["decode_needed_limit"]
    if row["prefill_stream_limit"] and row["prefill_tok_s"]:
        row["prefill_vs_stream"] = row["prefill_tok_s"] / row["prefill_stream_limit"]
    del llm, eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row


def _prefetch_layers(experts: dict) -> str | None:
    """'k of n': the layers whose next-layer guesses still prefetch (the precision gate's verdict)."""
    per_layer = experts.get("per_layer_guess")
    if not per_layer:
        return None
    return f"{sum(1 for g in per_layer.values() if g.get('prefetch'))} of {len(per_layer)}"


def fmt(v: object) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", default=None,
                    help="MODEL:BUDGET[:QUANTIZATION], MODEL a preset, a model folder or a .gguf file (repeatable; "
                         "'demo:cpu'; QUANTIZATION: fp8, nvfp4, ... for dummy experts in that format)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--settle-tokens", type=int, default=0,
                    help="tokens decoded before the measured decode, so that auto's trials can rule (default: 0)")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=None,
                    help="prefill chunk (max_num_batched_tokens; default: the planner's, 4096 when offloaded)")
    ap.add_argument("--ttft-prompt", type=int, default=4096, help="prompt tokens of the TTFT run (0: skip)")
    ap.add_argument("--prefill-prompt", type=int, default=8192, help="prompt tokens of the prefill run (0: skip)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (the per-layer graphs of offload decode)")
    ap.add_argument("--moe-strategy", default="auto",
                    help="auto | resident | offload | hybrid | cpu | layers[:N] (docs/configuration.md)")
    ap.add_argument("--expert-cache", default=None, help="override the plan's slot count (10%%, 0.1, 64)")
    ap.add_argument("--policy", default=None, choices=["lru", "lrfu"])
    ap.add_argument("--no-prefetch", action="store_true", help="no next-layer guesses / prefill streaming")
    ap.add_argument("--no-decode-prefetch", action="store_true",
                    help="no guessed experts copied in decode steps (decode_prefetch=False; prefill still streams)")
    ap.add_argument("--decode-misses", default="auto", choices=["auto", "copy", "link"],
                    help="copy: uncached experts copied into slots layer by layer; link: the decode step is one "
                         "CUDA graph whose kernel reads them over the link (experts/link_table.py); auto: the "
                         "planner's choice (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep only the first N layers (models bigger than the machine's RAM; the table says N)")
    ap.add_argument("--main-cpu", type=int, default=None,
                    help="pin this thread, which runs the engine's steps, to one CPU for the timed decode (Linux; "
                         "for the one-sequence decode's run-to-run spread)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rows = []
    for target in a.target or TARGETS:
        model, _, rest = target.partition(":")
        budget, _, quantization = rest.partition(":")
        rows.append(run_target(model, budget or "cpu", a, quantization or "none"))
        print(json.dumps(rows[-1]), file=sys.stderr)
    cols = ["model", "experts", "layers", "budget", "strategy", "decode_misses", "cuda_graph_mode", "cache_fraction", "link_gb_s", "decode_tok_s",
            "pred_decode_tok_s", "decode_ms_per_layer", "decode_hit_rate",
            "decode_link_limit", "decode_vs_link", "decode_vs_needed", "h2d_mib_per_token", "link_read_mib_per_token", "prefetch_precision", "prefetch_layers", "ttft_s", "pred_ttft_s",
            "prefill_tok_s", "prefill_stream_limit", "prefill_vs_stream"]
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
