"""Why does the CPU compute fewer experts while the link copies? Rates alone and together.

    python tools/diag_cpu_link.py [--seconds 2]

CPU side: gpt-oss-shaped MXFP4 experts in pinned host memory, one token each, through (a) one C
kernel call per expert (quant/cpu_layer.py LayerJob: Python only around the call) and (b)
fused_moe (torch ops around the kernel). Link side: the same experts copied host -> device on a side
stream from a second thread, synchronising every 8 copies. Each is timed alone, then together.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch

from ferryman.layers.fused_moe import MoEActivation, fused_moe
from ferryman.quant import get_format
from ferryman.quant.cpu_layer import LayerJob


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--experts", type=int, default=40)
    a = ap.parse_args()
    form = get_format("mxfp4")
    banks = form.random_banks(a.experts, 2880, 2880, True, torch.bfloat16, torch.Generator().manual_seed(0))
    banks = {k: v.pin_memory() for k, v in banks.items()}
    flat = [banks["w13_blocks"][e] for e in range(a.experts)]
    dev = torch.empty_like(flat[0], device="cuda")
    act = MoEActivation("swiglu_oai")
    x = torch.randn(1, 2880)
    stop = threading.Event()

    def link() -> float:
        stream, n, start = torch.cuda.Stream(), 0, time.perf_counter()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                for _ in range(8):
                    dev.copy_(flat[n % a.experts], non_blocking=True)
                    n += 1
                stream.synchronize()
        return n * flat[0].numel() / (time.perf_counter() - start) / 1e9

    def cpu(kind: str) -> float:
        n, start = 0, time.perf_counter()
        while not stop.is_set():
            e = n % a.experts
            if kind == "one-call":
                LayerJob(x, banks, 0, {e: ([0], [1.0])}, "swiglu_oai", 1.702, 7.0).run()
            else:
                fused_moe("mxfp4", banks, x.bfloat16(), torch.tensor([[e]]), torch.ones(1, 1), act)
            n += 1
        return n / (time.perf_counter() - start)

    def timed(fns: list) -> list[float]:  # noqa: ANN001
        stop.clear()
        out: list[float] = [0.0] * len(fns)
        threads = [threading.Thread(target=lambda i=i, f=f: out.__setitem__(i, f())) for i, f in enumerate(fns)]
        for t in threads:
            t.start()
        time.sleep(a.seconds)
        stop.set()
        for t in threads:
            t.join()
        return out

    torch.cuda.init()
    print(f"link alone: {timed([link])[0]:.1f} GB/s of w13 blocks")
    for kind in ("one-call", "fused_moe"):
        alone = timed([lambda k=kind: cpu(k)])[0]
        together = timed([lambda k=kind: cpu(k), link])
        print(f"{kind}: CPU alone {alone:.0f} experts/s; together {together[0]:.0f} experts/s with the link at "
              f"{together[1]:.1f} GB/s")
    sys.setswitchinterval(0.0002)  # the GIL handed over every 0.2 ms instead of 5 ms
    together = timed([lambda: cpu("fused_moe"), link])
    print(f"fused_moe, GIL switch interval 0.2 ms: together {together[0]:.0f} experts/s, link {together[1]:.1f} GB/s")


if __name__ == "__main__":
    main()
