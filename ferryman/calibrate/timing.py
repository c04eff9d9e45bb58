"""Timing of a repeated piece of work, shared by the calibration's measurements."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(rep: Callable[[], None], reps: int, warmup: int = 1, budget_s: float | None = None,
                   min_reps: int = 3) -> tuple[float, int]:
    """(median seconds of one rep, reps timed): `reps` of them, or with a budget as many as fit
    (at least `min_reps`, at most `reps`)."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    for _ in range(warmup):
        rep()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps:
        t0 = time.perf_counter()
        rep()
        times.append(time.perf_counter() - t0)
        if budget_s is not None and len(times) >= min_reps and time.perf_counter() - start > budget_s:
            break
    return statistics.median(times), len(times)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA; nothing elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
