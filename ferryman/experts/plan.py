"""The plan of one offloaded MoE layer step: plain data, made by one pure function.

Once a layer's expert ids are on the host (its one sync), `make_plan` decides from host-side
facts only (the distinct experts used, which of them the cache holds, how many slots are not in
use, the hybrid split's answer, the guesser's answers):
    hits      used experts already cached: used in place, never fetched again
    fetch     misses copied into slots before the kernel (demand copies)
    cpu       misses the CPU computes from the host store (hybrid split)
    prefetch  guesses for later layers, copied once the layer's kernel is issued
The executor (`OffloadExperts`, experts/offload.py) carries a plan out, for the eager path and
the per-layer CUDA graphs (engine/segment_graphs.py) alike.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

KINDS = ("stream", "full", "gap", "wrap")


@dataclass(frozen=True)
class Guess:
    """A guesser's answer for one later layer, its ids read on the host."""

    target: int  # the MoE layer guessed
    kind: str  # stream (a prefill chunk) | full | gap | wrap (decode): experts/guesses.py
    experts: tuple[int, ...]  # distinct guessed ids (decode: a token's most likely first)
    width: int | None = None  # full: experts a one-sequence guess copies; gap: at most this many


@dataclass(frozen=True)
class Prefetch:
    """Copies for a later layer, started after this layer's kernel. The cache skips experts it
    holds by then; a gap guess takes the first `limit` uncached ones, in order."""

    target: int
    kind: str
    experts: tuple[int, ...]  # the experts to copy, in the guess's order
    guessed: tuple[int, ...]  # everything guessed, graded when `target` runs
    tail: tuple[int, ...] | None = None  # a one-sequence guess's experts past its copy width (graded, not copied)
    limit: int | None = None  # gap: copy at most this many uncached experts


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    rows: int  # tokens of the step (decode: one per sequence)
    streaming: bool  # a prefill chunk touching about every expert
    hits: tuple[int, ...]  # cached experts the device uses, ascending
    fetch: tuple[int, ...]  # misses copied in before the kernel, ascending
    cpu: tuple[int, ...]  # misses computed on the CPU, ascending
    prefetch: tuple[Prefetch, ...]  # in issue order
    rounds: bool = False  # more experts than slots not in use: the layer runs in rounds (eager)
    cpu_units: float = 0.0  # what the split expects the CPU's part to cost, in 1-token experts

    @property
    def device(self) -> list[int]:
        """The experts the device kernel reads (acquired), ascending."""
        return sorted(self.hits + self.fetch)


def make_plan(layer: int, rows: int, streaming: bool, used: list[int], cached: Collection[int], available: int,
              cpu: list[int] | None, guesses: list[Guess], cpu_units: float = 0.0) -> LayerPlan:
    """The plan of `layer`'s step. used: distinct experts of the step, ascending; cached: those of
    `layer` in the cache; available: slots not in use; cpu: the hybrid split's misses for the CPU
    (None: no split applies) and `cpu_units` their cost; guesses: the guesser's answers, in issue
    order."""
    on_cpu = set(cpu or ())
    device = [e for e in used if e not in on_cpu]
    hits = tuple(e for e in device if e in cached)
    fetch = tuple(e for e in device if e not in cached)
    rounds = cpu is None and len(used) > available
    return LayerPlan(layer, rows, streaming, hits, fetch, tuple(sorted(on_cpu)),
                     tuple(_prefetch(g, rows) for g in guesses), rounds, cpu_units)


def _prefetch(g: Guess, rows: int) -> Prefetch:
    if g.kind not in KINDS:
        raise ValueError(f"guess kind must be one of {', '.join(KINDS)}, got {g.kind!r}")
    if g.kind == "gap":
        return Prefetch(g.target, g.kind, g.experts, g.experts, limit=g.width)
    if g.kind == "full" and rows == 1 and g.width is not None:  # most likely first: copy the head
        return Prefetch(g.target, g.kind, g.experts[: g.width], g.experts, tail=g.experts[g.width :])
    return Prefetch(g.target, g.kind, g.experts, g.experts)
