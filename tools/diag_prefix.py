"""Why a short prompt tail over a cached prefix costs what it does: TTFT of the tail alone, of the
tail over a cached prefix, and the GPU kernels and host functions of the cached turn.

    python tools/diag_prefix.py [--model gpt-oss-20b] [--load-format dummy] [--gpu-memory X]
                                [--prefix 4096] [--tail 128]

Every shape runs once unmeasured first (Triton compiles), with other token ids.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from ferryman import LLM, SamplingParams
from ferryman.engine.warm_up import warm_up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-oss-20b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--tail", type=int, default=128)
    a = ap.parse_args()
    llm = LLM(a.model, load_format=a.load_format, gpu_memory=a.gpu_memory, max_model_len=a.prefix + a.tail + 16,
              max_num_seqs=1)
    warm_up(llm.engine)
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.cfg.vocab_size

    def rand(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    def ttft(ids: list[int]) -> tuple[float, int]:
        out = llm.generate(prompt_token_ids=[ids], params=SamplingParams(temperature=0.0, max_tokens=1))[0]
        return out.metrics.ttft_s * 1e3, out.metrics.num_cached_tokens

    for rnd in ("unmeasured", "measured"):
        tail_alone = ttft(rand(a.tail))
        prefix, tail = rand(a.prefix), rand(a.tail)
        first = ttft(prefix)
        cached = ttft(prefix + tail)
        print(f"{rnd}: tail alone {tail_alone[0]:.1f} ms; prefix {first[0]:.1f} ms; "
              f"tail over the cached prefix {cached[0]:.1f} ms ({cached[1]} cached)")
    prefix, tail = rand(a.prefix), rand(a.tail)
    ttft(prefix)
    host = cProfile.Profile()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        host.enable()
        print(f"profiled cached turn: {ttft(prefix + tail)[0]:.1f} ms (profiler overhead included)")
        host.disable()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=70))
    pstats.Stats(host).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
