"""`moe_strategy auto`'s check that the hybrid split pays: decode steps timed with it and without.
The same trial decides whether auto's link reads stay (`link_reads_trial`, engine/segment_graphs.py).

The split's balance comes from rates measured apart (`ferryman bench bw`); what it costs a decode
step beside them (the CPU job's hand-off, guesses the link leaves to the CPU, the worker sharing
host memory with the link) is only seen in whole steps. On the H200 machine, gpt-oss-20b at 8 GiB
decoded one sequence at 48.9-52.1 tok/s with the split and 55.6-57.6 without (docs/benchmarks.md),
while the split's own rate check (HybridSplit._fall_back) saw nothing wrong.

So under auto the split starts on trial: the engine's decode-only steps alternate between windows
of WINDOW steps with the split and without it. Once some batch size has MIN_STEPS steps of each
kind, the split stays on only if its median step is at least KEEP_MARGIN faster; else auto runs
plain offload from then on. Steps with prefill tokens are not counted (their time is the prompt's).

Link reads (`decode_misses` auto picks them for formats the kernel reads well over the link) change
what the cache holds: link steps admit misses selectively, the copy path admits every miss. On the
H200 machine gpt-oss-120b with int4 experts at 16 GiB decoded at 13.9 tok/s with link reads (hit
rate 0.24) and 23.0 with copies (0.54), while qwen3-30b-a3b's link steps won 1.45-2.4x
(docs/benchmarks.md). So their trial's windows are longer, and the first LINK_SKIP steps of each
window, while the cache settles into the window's way, are not timed.

Invariant: a verdict is final; `on` is True while no verdict is in and the current window is one
with the split (link reads), or after a verdict to keep it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

WINDOW = 16  # decode steps per window, with the split or without it
MIN_STEPS = 32  # steps of one batch size, each way, before a verdict (two windows each at least)
KEEP_MARGIN = 0.03  # the split stays only when its median step is this much faster than without
LINK_WINDOW = 32  # decode steps per window of the link trial
LINK_SKIP = 16  # steps at the start of each such window that are not timed (the cache settling)
LINK_MARGIN = -0.03  # link reads stay unless their median step is this much slower than the copy path's


@dataclass
class SplitTrial:
    window: int = WINDOW
    min_steps: int = MIN_STEPS
    margin: float = KEEP_MARGIN
    skip: int = 0  # steps at the start of each window that are counted but not timed
    subject: str = "the split"  # what is on trial, in the reason
    fallback: str = "offload"  # what runs after a verdict against it
    other: str = "without"  # the steps without it, in the reason
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
        if self.steps % self.window >= self.skip:
            self.times.setdefault((batch, self.on), []).append(seconds)
        self.steps += 1
        for b in sorted({b for b, _ in self.times}):
            with_split, without = self.times.get((b, True), []), self.times.get((b, False), [])
            if min(len(with_split), len(without)) >= self.min_steps:
                return self._decide(b, statistics.median(with_split), statistics.median(without))
        return None

    def restart(self) -> None:
        """Forget the samples (after a warm-up, whose steps pay compiles); a verdict stays."""
        if self.verdict is None:
            self.steps, self.times = 0, {}

    def _decide(self, batch: int, with_split: float, without: float) -> bool:
        self.verdict = with_split <= (1.0 - self.margin) * without
        self.reason = (f"{'kept' if self.verdict else 'fell back to ' + self.fallback} after a trial: decode "
                       f"steps of {batch} sequence(s) took {with_split * 1e3:.2f} ms with {self.subject}, "
                       f"{without * 1e3:.2f} ms {self.other}")
        return self.verdict

    def as_dict(self) -> dict:
        return {"steps": self.steps, "verdict": self.verdict, "reason": self.reason}


def link_reads_trial() -> SplitTrial:
    """The trial of auto's link reads against the copy path."""
    return SplitTrial(window=LINK_WINDOW, min_steps=LINK_WINDOW, margin=LINK_MARGIN, skip=LINK_SKIP,
                      subject="link reads", fallback="copies", other="with copies")
