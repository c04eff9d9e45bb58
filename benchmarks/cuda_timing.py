"""Timing helpers shared by the micro-benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def cuda_seconds(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Mean wall seconds of `fn` over `reps` calls, the device synchronised before and after."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def median_seconds(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median wall seconds of one call of `fn`, from launch to completion: each call is timed alone
    and, on a CUDA machine, the device is synchronised after it (host overhead included, as in an
    eager prefill step)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
