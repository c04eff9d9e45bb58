"""Where one sequence's decode steps spend their time: a torch profile of N steps, in process.

    python benchmarks/profile_decode.py [--model PRESET|FOLDER] [--load-format dummy] [--layers N]
        [--gpu-memory 8GiB] [--quantization int4] [--decode-misses auto|copy|link]
        [--settle 160] [--steps 32] [--gaps]

After warm-up, a 128-token prompt decodes --settle tokens unprofiled (the cache, the guesses' gates
and auto's trials settle), then --steps more under torch.profiler: the kernels by GPU time and the
host's ops by their own time, each per step; `--gaps` (CUDA): where the busiest stream waits,
summed by the kernels around each gap (profile_prefill.stream_gaps). Whether a step is bound by
its kernels, its copies or the host between them: the decode rows of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
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
from profile_prefill import add_model_args, stream_gaps  # noqa: E402


def decode(llm: LLM, prompt: list[int], tokens: int) -> tuple[int, float]:
    """Prefill `prompt`, then step the engine through `tokens` decode steps: (steps, seconds)."""
    eng = llm.engine
    rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True))
    eng.step()  # the prompt
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    steps, t0 = 0, time.perf_counter()
    while rid in eng.requests:
        eng.step()
        steps += 1
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    eng.pop_output(rid)
    return steps, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--decode-misses", default="auto", choices=["auto", "copy", "link"])
    ap.add_argument("--settle", type=int, default=160, help="decode steps before the profile (default: 160)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps profiled (default: 32)")
    ap.add_argument("--gaps", action="store_true")
    a = ap.parse_args()
    source = fewer_layers(a.model, a.layers) if a.layers else a.model
    llm = LLM(source, load_format=a.load_format, gpu_memory=a.gpu_memory, quantization=a.quantization,
              device=a.device, max_num_seqs=1, decode_misses=a.decode_misses,
              max_model_len=128 + a.settle + a.steps + 64)
    print(describe_plan(llm.engine.plan))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, llm.engine.cfg.vocab_size, (128,), generator=gen).tolist()
    warm_up(llm.engine)
    steps, seconds = decode(llm, prompt, a.settle)
    st = llm.stats()
    print(f"settle: {steps} steps, {steps / seconds:.1f} tok/s; graphs {st['cuda_graph_mode']}, "
          f"link trial {st['link_trial']}")
    from torch.profiler import ProfilerActivity, profile

    cuda = llm.engine.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        steps, seconds = decode(llm, prompt[:64], a.steps)
    print(f"profiled: {steps} steps, {seconds / steps * 1e3:.2f} ms a step (the profiler's cost included)")
    key = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    if a.gaps and cuda:
        with tempfile.TemporaryDirectory() as d:
            prof.export_chrome_trace(f"{d}/trace.json")
            stream_gaps(Path(d) / "trace.json")


if __name__ == "__main__":
    main()
