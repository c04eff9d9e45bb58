"""One layer of CPU experts (the C kernel through `fused_moe`, one token) timed on the main thread and
on a second thread, after the main thread has run OpenMP parallel regions.

    python benchmarks/bench_thread_teams.py [--model gpt-oss-20b --load-format dummy --layers 2] [--calls 500]

An OpenMP runtime keeps a team of threads for every thread that ran a parallel region, until that
thread ends. Once the teams hold more threads than the machine has cores, libgomp stops spinning in
its barriers and sleeps, and every region pays for waking its team. The engine runs the CPU expert
kernel on worker threads (the hybrid split's `CPUExperts`, the server's engine loop), so what
matters is the second row against the first. The third row is the main thread again.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from fewer_layers import fewer_layers
from ferryman import LLM
from ferryman.layers.fused_moe import fused_moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="preset or folder (default: the demo model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    ap.add_argument("--calls", type=int, default=500, help="calls per timing (default: 500)")
    a = ap.parse_args()
    source = fewer_layers(a.model, a.layers) if a.layers else a.model
    llm = LLM(source, load_format=a.load_format, device="cpu", moe_strategy="resident", max_model_len=256)
    eng = llm.engine
    store, layer = eng.runner.experts.store, eng.cfg.moe_layers[0]
    fmt, banks, act = store.format.name, store.banks[layer], eng.runner.experts.act
    k = eng.cfg.top_k
    x = torch.randn(1, eng.cfg.hidden_size, dtype=eng.runner.model.embed_tokens.weight.dtype)
    ids, w = torch.arange(k).view(1, k), torch.full((1, k), 1.0 / k)
    print(f"{fmt} experts, top-{k}, {torch.get_num_threads()} threads, {a.calls} calls per row")

    def timed(label: str) -> None:
        with torch.inference_mode():
            for _ in range(20):
                fused_moe(fmt, banks, x, ids, w, act)
            times = []
            for _ in range(a.calls):
                t = time.perf_counter()
                fused_moe(fmt, banks, x, ids, w, act)
                times.append(time.perf_counter() - t)
        print(f"{label:40s} median {statistics.median(times) * 1e6:8.1f} us")

    timed("main thread")
    second = threading.Thread(target=timed, args=("second thread (main's team alive)",))
    second.start()
    second.join()
    timed("main thread again")


if __name__ == "__main__":
    main()
