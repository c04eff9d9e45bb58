"""benchmarks/host_usage.py: the figures bench_offload reports for a decode phase's host side."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # not an installed package
from host_usage import HostUsage  # noqa: E402

linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not Path("/proc/thread-self/stat").exists(),
                           reason="needs Linux's per-thread affinity and /proc")


@linux
def test_last_cpu_is_the_cpu_the_thread_is_pinned_to() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    try:
        for cpu in allowed[-2:]:  # the last CPUs: not just CPU 0, which a wrong /proc field reads as
            os.sched_setaffinity(0, {cpu})
            with HostUsage() as host:
                sum(range(10000))
            fig = host.figures("decode")["decode_host"]
            assert fig["last_cpu"] == cpu and fig["cpus"] == 1
            assert cpu in {int(c) for part in fig["cpu_siblings"].split(",") for c in _span(part)}
    finally:
        os.sched_setaffinity(0, set(allowed))


def _span(part: str) -> range:
    """A siblings list entry ("3" or "2-3") as a range."""
    lo, _, hi = part.partition("-")
    return range(int(lo), int(hi or lo) + 1)


@linux
def test_busy_threads_name_a_thread_that_spun_through_the_phase() -> None:
    import threading
    import time

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin, name="spinner")
    try:
        with HostUsage() as host:  # a thread counts while it lives: the spinner ends after the phase
            worker.start()
            time.sleep(0.5)  # this thread idles; the spinner takes a CPU (or shares one under the GIL)
    finally:
        stop.set()
        worker.join()
    busy = host.figures("decode")["decode_host"]["busy_threads"]
    assert busy and busy[0]["tid"] == worker.native_id and busy[0]["cpu_s"] >= 0.1
    assert all(b["tid"] != threading.get_native_id() for b in busy)


def test_the_probe_and_the_gpu_clocks_are_reported() -> None:
    """The probe's two timings (before and after the phase) are reported; without nvidia-smi the GPU's
    clocks read None rather than failing."""
    import shutil

    from host_usage import probe_us

    with HostUsage() as host:
        pass
    fig = host.figures("decode")["decode_host"]
    assert len(fig["probe_us"]) == 2 and all(t > 0 for t in fig["probe_us"])
    assert probe_us(reps=3) > 0
    assert (fig["gpu_clocks"] is None) == (shutil.which("nvidia-smi") is None)
