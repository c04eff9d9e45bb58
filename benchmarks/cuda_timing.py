"""Timing helper shared by the CUDA micro-benchmarks."""

from __future__ import annotations

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
