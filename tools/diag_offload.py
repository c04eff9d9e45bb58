"""Where offloaded decode and prefill spend their time on CUDA: host profile, allocator retries,
copy kinds, GPU kernel time.

    python tools/diag_offload.py [--model gpt-oss-20b] [--budget 8GiB] [--tokens 64] [--prefill 2048]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import time
from collections.abc import Callable, Iterator

import torch

from ferryman import LLM, SamplingParams


def run(llm: LLM, n: int) -> float:
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=[list(range(100, 228))], params=p)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-oss-20b")
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=0, help="also profile one prompt of this many tokens")
    ap.add_argument("--eager", action="store_true", help="no per-layer CUDA graphs")
    a = ap.parse_args()
    llm = LLM(a.model, load_format="dummy", gpu_memory=a.budget, max_model_len=max(4096, a.prefill + 64), max_num_seqs=1,
              enforce_eager=a.eager)
    print("cuda graphs:", llm.stats()["cuda_graph_mode"], "slots:", llm.stats()["experts"]["slots"])
    if a.tokens > 0:
        decode(llm, a.tokens)
    if a.prefill:
        prefill(llm, a.prefill)


def decode(llm: LLM, tokens: int) -> None:
    """Offloaded decode: rate, expert counters, allocator, host profile, copy kinds."""
    run(llm, 8)
    keys = ("hits", "misses", "prefetch_fetched", "prefetch_hits", "bytes_h2d", "copies_h2d", "h2d_seconds",
            "stall_seconds", "host_pinned", "slots")
    e0 = llm.stats()["experts"]
    m0 = torch.cuda.memory_stats()
    prof = cProfile.Profile()
    prof.enable()
    rate = run(llm, tokens)
    prof.disable()
    e1 = llm.stats()["experts"]
    m1 = torch.cuda.memory_stats()
    print(f"decode {rate:.1f} tok/s ({1e3 / rate:.1f} ms/token)")
    print({k: (e1[k] - e0[k] if isinstance(e1.get(k), (int, float)) and not isinstance(e1.get(k), bool) else e1.get(k))
           for k in keys if k in e1})
    print({k: m1.get(k, 0) - m0.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                                   "num_ooms", "num_sync_all_streams")})
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(22)
    st.sort_stats("cumtime").print_stats(30)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr, _marked():
        run(llm, 16)
    overlap(pr)
    timeline(pr, start_copy=200, span_ms=40.0)  # about one token, a few tokens in
    llm.engine.runner.rebind_experts(prefetch=False)
    print(f"no prefetch: {run(llm, tokens):.1f} tok/s")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
        run(llm, 8)
    print(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    rows = [e for e in pr.key_averages() if "Memcpy" in e.key or "memcpy" in e.key.lower()]
    for e in rows:
        print("copy kind:", e.key, e.count)


def prefill(llm: LLM, n: int) -> None:
    """One n-token prompt (chunked like the engine does): wall time, host profile, GPU kernels."""
    from torch.profiler import ProfilerActivity, profile

    p = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prompt_token_ids=[list(range(7000, 7512))], params=p)  # warm-up: kernel compiles
    prompt = [list(range(100, 100 + n))]
    m0 = torch.cuda.memory_stats()
    e0 = llm.stats()["experts"]
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate(prompt_token_ids=prompt, params=p)
    torch.cuda.synchronize()
    prof.disable()
    wall = time.perf_counter() - t0
    e1 = llm.stats()["experts"]
    plan = llm.engine.plan
    print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB of the plan's "
          f"{plan.total_bytes / 2**30:.2f} GiB (activations planned: {plan.activation_bytes / 2**30:.2f} GiB)")
    moved = e1["bytes_h2d"] - e0["bytes_h2d"]
    print(f"prefill {n} tokens: {wall:.2f} s ({n / wall:.0f} tok/s), {moved / 1e9:.2f} GB copied "
          f"({moved / wall / 1e9:.1f} GB/s), h2d {e1['h2d_seconds'] - e0['h2d_seconds']:.2f} s, "
          f"stall {e1['stall_seconds'] - e0['stall_seconds']:.2f} s")
    m1 = torch.cuda.memory_stats()
    print({k: m1.get(k, 0) - m0.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")})
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    other = [[t + n for t in prompt[0]]]  # new token ids: the prefix cache must not skip the work
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr, _marked():
        llm.generate(prompt_token_ids=other, params=p)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = pr.key_averages()
    busy = sum(e.self_device_time_total for e in events if "Memcpy" not in e.key) / 1e6
    copy = sum(e.self_device_time_total for e in events if "Memcpy" in e.key) / 1e6
    print(f"profiled prefill: wall {wall:.2f} s, kernels {busy:.2f} s (copies excluded), copies {copy:.2f} s")
    overlap(pr)
    timeline(pr)
    print("GPU time:")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:18]:
        print(f"  {e.self_device_time_total / 1e3:9.1f} ms  x{e.count:6d}  {e.key[:100]}")
    print("host time (self):")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:18]:
        print(f"  {e.self_cpu_time_total / 1e3:9.1f} ms  x{e.count:6d}  {e.key[:100]}")


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        total += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap(pr) -> None:  # noqa: ANN001 (torch.profiler.profile)
    """From the profile's device events: how long the link copied, the kernels ran, both at once,
    and neither, over the span from the first to the last device event (µs -> s). Copies and
    kernels that never overlap mean the pipeline serialises; the longest copy-idle gaps with the
    kernels that ran in them say where."""
    copies, kernels = [], []
    for e in pr.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.end <= e.time_range.start \
                or e.name.startswith("mark::"):  # _marked's ranges as the device saw them
            continue
        span = (e.time_range.start / 1e6, e.time_range.end / 1e6)
        if "HtoD" in e.name:  # the link; device-to-device copies run on the GPU like kernels
            copies.append(span)
        elif "Memcpy" not in e.name:
            kernels.append(span)
    if not copies or not kernels:
        print("overlap: no device copies or kernels in the profile")
        return
    c, k = _union(copies), _union(kernels)
    first, last = min(c[0][0], k[0][0]), max(c[-1][1], k[-1][1])
    both = _intersect(c, k)
    total = last - first
    print(f"device span {total:.3f} s: copies {_length(c):.3f} s, kernels {_length(k):.3f} s, both at once "
          f"{both:.3f} s, neither {total - _length(c) - _length(k) + both:.3f} s")
    gaps = sorted(((b[0] - a[1], a[1]) for a, b in zip(c, c[1:])), reverse=True)[:8]
    for gap, at in gaps:
        busy = _intersect([(at, at + gap)], k)
        print(f"  link idle {gap * 1e3:7.2f} ms at +{(at - first) * 1e3:8.1f} ms, kernels busy {busy * 1e3:6.2f} ms of it")


@contextlib.contextmanager
def _marked() -> Iterator[None]:
    """Name the host's steps of an offloaded MoE layer in the profile: the routing sync, the
    guesses' copies being issued, the MoE kernels being launched."""
    from torch.profiler import record_function

    from ferryman.experts import offload

    def wrap(fn: Callable, name: str) -> Callable:
        def marked(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 (a pass-through)
            with record_function(name):
                return fn(*args, **kwargs)
        return marked

    saved = (offload.host_ids_of, offload.fused_moe, offload.OffloadExperts.issue_prefetches)
    offload.host_ids_of = wrap(saved[0], "mark::sync")
    offload.fused_moe = wrap(saved[1], "mark::moe_launch")
    offload.OffloadExperts.issue_prefetches = wrap(saved[2], "mark::issue_copies")
    try:
        yield
    finally:
        offload.host_ids_of, offload.fused_moe, offload.OffloadExperts.issue_prefetches = saved


def timeline(pr, start_copy: int = 40, span_ms: float = 200.0) -> None:  # noqa: ANN001 (torch.profiler.profile)
    """~span_ms of the profile from the start_copy-th device copy on, in time order: device copies,
    runs of kernels (gaps under 20 µs merged) and the host marks of `_marked` (ms from the window's
    start). Shows which waits for which in the prefill pipeline."""
    dev, host = [], []
    for e in pr.events():
        a, b = e.time_range.start / 1e3, e.time_range.end / 1e3  # µs -> ms
        if e.name.startswith("mark::"):
            if e.device_type != torch.autograd.DeviceType.CUDA:
                host.append((a, b, "host", e.name[6:]))
        elif e.device_type == torch.autograd.DeviceType.CUDA and b > a and "DtoD" not in e.name:
            dev.append((a, b, "COPY" if "Memcpy" in e.name else "kern", e.name))
    copies = sorted(x for x in dev if x[2] == "COPY" and "Pinned" in x[3])  # the experts' copies
    if len(copies) <= start_copy:
        print("timeline: too few copies")
        return
    t0 = copies[start_copy][0]
    inside = lambda x: t0 <= x[0] < t0 + span_ms  # noqa: E731
    runs: list[list] = []
    for a, b, kind, name in sorted(x for x in dev if x[2] == "kern" and inside(x)):
        if runs and a - runs[-1][1] < 0.02:
            runs[-1][1] = max(runs[-1][1], b)
            runs[-1][3] += 1
        else:
            runs.append([a, b, name[:40], 1])
    rows = [(a, b, "COPY", n) for a, b, _, n in copies if inside((a,))] + \
        [(a, b, f"kernels x{n}", name) for a, b, name, n in runs] + [x for x in host if inside(x)]
    print(f"timeline from copy {start_copy} (+ms, duration ms):")
    for a, b, kind, name in sorted(rows):
        print(f"  {a - t0:8.2f} {b - a:7.2f}  {kind:12s} {name[:60]}")


if __name__ == "__main__":
    main()
