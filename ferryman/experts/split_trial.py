"""`moe_strategy auto`'s check that the hybrid split pays: decode steps timed with it and without.

The split's balance comes from rates measured apart (`ferryman bench bw`); what it costs a decode
step beside them (the CPU job's hand-off, guesses the link leaves to the CPU, the worker sharing
host memory with the link) is only seen in whole steps. On the H200 machine, gpt-oss-20b at 8 GiB
decoded one sequence at 48.9-52.1 tok/s with the split and 55.6-57.6 without (docs/benchmarks.md),
while the split's own rate check (HybridSplit._fall_back) saw nothing wrong.

So under auto the split starts on trial: the engine's decode-only steps alternate between windows
of WINDOW steps with the split and without it. Once some batch size has MIN_STEPS steps of each
kind, the split stays on only if its median step is at least KEEP_MARGIN faster; else auto runs
plain offload from then on. Steps with prefill tokens are not counted (their time is the prompt's).

Invariant: a verdict is final; `on` is True while no verdict is in and the current window is one
with the split, or after a verdict to keep it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

WINDOW = 16  # decode steps per window, with the split or without it
MIN_STEPS = 32  # steps of one batch size, each way, before a verdict (two windows each at least)
KEEP_MARGIN = 0.03  # the split stays only when its median step is this much faster than without


@dataclass
class SplitTrial:
    window: int = WINDOW
    min_steps: int = MIN_STEPS
    margin: float = KEEP_MARGIN
    steps: int = 0  # decode-only steps counted so far
    times: dict[tuple[int, bool], list[float]] = field(default_factory=dict)  # (batch, split on) -> seconds
    verdict: bool | None = None  # None: still on trial; True: keep the split; False: off for good
    reason: str = ""

    @property
    def on(self) -> bool:
        """Whether the split runs in the coming step."""
        if self.verdict is not None:
            return self.verdict
        return (self.steps // self.window) % 2 == 0

    def note(self, seconds: float, batch: int, decode_only: bool) -> bool | None:
        """An engine step took `seconds` for `batch` sequences; returns the verdict once it is in
        (at this step: True or False; None before and after)."""
        if self.verdict is not None or not decode_only or batch < 1 or seconds <= 0:
            return None
        self.times.setdefault((batch, self.on), []).append(seconds)
        self.steps += 1
        for b in sorted({b for b, _ in self.times}):
            with_split, without = self.times.get((b, True), []), self.times.get((b, False), [])
            if min(len(with_split), len(without)) >= self.min_steps:
                return self._decide(b, statistics.median(with_split), statistics.median(without))
        return None

    def _decide(self, batch: int, with_split: float, without: float) -> bool:
        self.verdict = with_split <= (1.0 - self.margin) * without
        self.reason = (f"{'kept' if self.verdict else 'fell back to offload'} after a trial: decode steps of "
                       f"{batch} sequence(s) took {with_split * 1e3:.2f} ms with the split, {without * 1e3:.2f} ms "
                       f"without")
        return self.verdict
