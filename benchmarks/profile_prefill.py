"""Where a prefill spends its time: each engine step timed, optionally a torch profile or the
compute stream's gaps (GPU), in process.

    python benchmarks/profile_prefill.py [--model PRESET|FOLDER] [--load-format dummy] [--layers N]
        [--gpu-memory 8GiB] [--quantization int4] [--max-model-len N] [--max-num-seqs N]
        [--lengths 4170,16384] [--turn 200] [--profile] [--gaps] [--python]

Each length runs twice (after warm-up): a fresh random prompt, timed from submission to its first
token, with the time of each engine step. `--turn T`: then the last prompt plus T new tokens (an
agent's next turn: the prefix cache serves the rest) and a cold prompt of the same total length.
`--profile`: the last prompt once more under torch.profiler, its kernels by GPU time and ops by
host time. `--gaps` (CUDA): the same run's trace, where the busiest stream waits, summed by the
kernels around each gap. `--python`: the last prompt once more under cProfile, the engine's Python
functions by their own time (where the host spends a step; a wait on the device shows in the call
that reads it back). Used for the step tables in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from ferryman import LLM, SamplingParams
from ferryman.engine.warm_up import warm_up
from ferryman.plan_report import describe_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fewer_layers import fewer_layers  # noqa: E402


def sync(llm: LLM) -> None:
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()


def first_token(llm: LLM, ids: list[int], label: str) -> float:
    """Submit one prompt, step the engine to its first token; prints TTFT, cached tokens, steps."""
    sync(llm)
    rid = llm.engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1))
    steps = []
    while rid in llm.engine.requests:
        t0 = time.perf_counter()
        llm.engine.step()
        sync(llm)
        steps.append(time.perf_counter() - t0)
    out = llm.engine.pop_output(rid)
    print(f"{label}: TTFT {out.metrics.ttft_s * 1e3:.1f} ms, {out.metrics.num_cached_tokens} cached, "
          f"steps {[round(s * 1e3, 1) for s in steps]} ms", flush=True)
    return out.metrics.ttft_s


def stream_gaps(trace: Path, top: int = 12) -> None:
    """The busiest stream's idle time between its ops, summed by (op before, op after)."""
    events = json.loads(trace.read_text())["traceEvents"]
    streams: dict[object, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            streams[e["args"].get("stream")].append(e)
    for s, ops in sorted(streams.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        ops.sort(key=lambda e: e["ts"])
        span = ops[-1]["ts"] + ops[-1]["dur"] - ops[0]["ts"]
        print(f"stream {s}: {len(ops)} ops, busy {sum(e['dur'] for e in ops) / 1e3:.1f} ms of {span / 1e3:.1f} ms")
    main = max(streams.values(), key=lambda ops: sum(e["dur"] for e in ops if e["cat"] == "kernel"))
    gaps: collections.Counter[tuple[str, str]] = collections.Counter()
    for a, b in zip(main, main[1:]):
        gaps[(a["name"][:48], b["name"][:48])] += max(b["ts"] - a["ts"] - a["dur"], 0)
    print(f"busiest stream idle {sum(gaps.values()) / 1e3:.1f} ms; the largest causes:")
    for (a, b), us in gaps.most_common(top):
        print(f"  {us / 1e3:7.1f} ms  after {a}  before {b}")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model and engine flags the profiling scripts share."""
    ap.add_argument("--model", default=None, help="preset or folder (default: the demo model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--device", default="auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the longest prompt + --turn + 16")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the prefill chunk; default: the engine's")
    ap.add_argument("--lengths", default="1024", help="prompt lengths, comma-separated")
    ap.add_argument("--turn", type=int, default=0, help="new tokens of a second turn on the last prompt")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--gaps", action="store_true")
    ap.add_argument("--python", action="store_true")
    a = ap.parse_args()
    lengths = [int(n) for n in a.lengths.split(",")]
    longest = max(lengths) + 2 * a.turn + 16
    source = fewer_layers(a.model, a.layers) if a.layers else a.model
    llm = LLM(source, load_format=a.load_format, gpu_memory=a.gpu_memory, quantization=a.quantization,
              device=a.device, max_model_len=a.max_model_len or longest, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens)
    print(describe_plan(llm.engine.plan))
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.cfg.vocab_size

    def rand(n: int) -> list[int]:  # fresh ids: no prefix-cache hit between draws
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    warm_up(llm.engine)
    last: list[int] = []
    for n in lengths:
        for _ in range(2):
            last = rand(n)
            first_token(llm, last, f"prompt {n}")
    if a.turn:
        cached = first_token(llm, last + rand(a.turn), f"next turn, {a.turn} new tokens")
        cold = first_token(llm, rand(len(last) + a.turn), f"cold prompt of {len(last) + a.turn}")
        print(f"speed-up of the cached turn: {cold / cached:.1f}x")
    if a.profile or a.gaps:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if llm.engine.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            first_token(llm, rand(lengths[-1]), f"prompt {lengths[-1]}, profiled")
        if a.profile:
            key = "cuda_time_total" if len(acts) > 1 else "cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
        if a.gaps and len(acts) > 1:
            with tempfile.TemporaryDirectory() as d:
                prof.export_chrome_trace(f"{d}/trace.json")
                stream_gaps(Path(d) / "trace.json")
    if a.python:
        import cProfile
        import pstats

        with cProfile.Profile() as py:
            first_token(llm, rand(lengths[-1]), f"prompt {lengths[-1]}, under cProfile")
        pstats.Stats(py).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
