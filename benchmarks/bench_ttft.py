"""Time to first token of fresh prompts by length, after `ferryman serve`'s warm-up.

    python benchmarks/bench_ttft.py [--model FOLDER|PRESET] [--load-format auto] [--device cpu]
                                    [--dtype auto] [--prompts 16,64,256,512] [--reps 3]

Each prompt is random token ids (no prefix-cache hit), one greedy token; prints the median and
every run. Compare commits by running it on each (the CPU prefill paths have no switch).
--profile N: then one more N-token prompt under cProfile, its 12 costliest functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import platform
import pstats
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefix_cache import ttft  # noqa: E402

from ferryman import LLM  # noqa: E402
from ferryman.engine.warm_up import warm_up  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or preset (default: the demo model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", default="16,64,256,512", help="prompt lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="then profile one N-token prompt")
    a = ap.parse_args()
    sizes = [int(s) for s in a.prompts.split(",")]
    llm = LLM(a.model, device=a.device, dtype=a.dtype, load_format=a.load_format,
              max_model_len=max(sizes + [a.profile]) + 16, max_num_seqs=1)
    warm_up(llm.engine)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.cfg.vocab_size
    print(f"machine: {platform.machine()}, device {llm.engine.device}, torch {torch.__version__}, "
          f"model {a.model or 'bundled demo model'}, dtype {llm.engine.plan.request.dtype}")
    for n in sizes:
        times = []
        for _ in range(a.reps):
            times.append(ttft(llm, torch.randint(1, vocab, (n,), generator=gen).tolist())[0] * 1e3)
        print(f"{n}-token prompt: TTFT median {statistics.median(times):.1f} ms "
              f"({', '.join(f'{t:.1f}' for t in times)})", flush=True)
    if a.profile:
        prompt = torch.randint(1, vocab, (a.profile,), generator=gen).tolist()
        prof = cProfile.Profile()
        prof.runcall(ttft, llm, prompt)
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
