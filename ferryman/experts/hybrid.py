"""The hybrid split: misses computed on the CPU, where their weights already are, while the link
fetches the others.

Per MoE layer and decode step, with M misses, the link's rate r_link and the CPU's rate r_cpu
(experts per second, measured on this machine for this model's experts: ferryman/calibrate/):
fetch F of them and compute the M - F others on the CPU at the same time, F minimising

    max(F / r_link, sum of the CPU's costs)        (both sides finish together)

An expert with n tokens costs the CPU (1 + slope * (n - 1)) / r_cpu (`units`). A split that would
give the CPU fewer than MIN_CPU misses fetches them all; each CPU job also costs CPU_JOB_SECONDS once
(a copy of x to the host, a hand-off, the kernel's threads waking), so one miss goes to the CPU only
when that leaves both sides ending sooner. The fetched ones are the misses used most recently and most often
(`ReuseHistory`): fetching is what puts them in the cache; the others are computed, not cached.

It applies to decode-sized steps only (at most MAX_SPLIT_TOKENS tokens, not a streaming prefill
chunk). `decide`: "off" never; "on" always; "auto" on a CUDA device when the CPU reaches at least
MIN_CPU_SHARE of the link's rate (on a CPU-only machine the slots and the store share one memory).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ferryman.calibrate.bandwidth import ExpertCycle, Rep, quick_calibration
from ferryman.calibrate.timing import sync
from ferryman.calibrate.calibration import Calibration, expert_key, load_matching, token_slope
from ferryman.experts.split_trial import SplitTrial
from ferryman.layers.fused_moe import MoEActivation

if TYPE_CHECKING:
    from ferryman.experts.gpu_cache import ExpertCache

log = logging.getLogger("ferryman.experts")

MIN_CPU_SHARE = 0.25  # auto: hybrid only if r_cpu >= 0.25 x r_link
MAX_SPLIT_TOKENS = 16  # steps with more tokens are not split (prefill chunks stream whole experts)
OBSERVE_WEIGHT = 0.05  # each finished CPU job's weight in the rate the split uses
RELAX_PER_STEP = 0.02  # per engine step, the share of the way back to the calibrated CPU rate
MIN_CPU = 1  # a layer step computes misses on the CPU only if the split gives it at least this many
# what a CPU job costs beside its experts: x copied to the host, the hand-off to the worker, the
# kernel's threads waking, the [T, H] part copied back; the split counts it once per layer step, so
# a lone miss goes to the CPU only when the CPU alone beats the link by this much
CPU_JOB_SECONDS = 1e-4
SPLIT_MODES = ("off", "auto", "on")  # moe_strategy offload | auto | hybrid (experts/placement.py)
FALLBACK_SHARE = 0.8  # auto: the split stops when the CPU runs below this share of its predicted rate
FALLBACK_JOBS = 64  # ... judged after this many CPU jobs


def split_fetch(misses: int, r_link: float, r_cpu: float) -> int:
    """How many of `misses` to fetch so that fetching (F / r_link) and computing the rest on the CPU
    ((misses - F) / r_cpu) end together; a tie goes to fetching (fetched experts get cached)."""
    if misses < 0 or r_link < 0 or r_cpu < 0 or not (math.isfinite(r_link) and math.isfinite(r_cpu)):
        raise ValueError(f"split_fetch needs misses >= 0 and finite rates >= 0, got {misses}, {r_link}, {r_cpu}")
    if misses == 0 or r_cpu == 0:
        return misses
    return split_costs([1.0 / r_cpu] * misses, r_link)


def split_costs(costs: list[float], r_link: float, job_seconds: float = 0.0) -> int:
    """F: fetch the first F misses (at r_link experts/s) while the CPU computes the others, miss i
    costing it costs[i] seconds and the job `job_seconds` once, so that the later of the two ends
    first; a tie goes to fetching."""
    if r_link <= 0:
        return 0
    # tail[f]: the CPU's time when the first f are fetched
    tail = [0.0] * (len(costs) + 1)
    for i in range(len(costs) - 1, -1, -1):
        tail[i] = tail[i + 1] + costs[i] + (job_seconds if i == len(costs) - 1 else 0.0)
    return min(range(len(costs) + 1), key=lambda f: (max(f / r_link, tail[f]), -f))


@dataclass(frozen=True)
class HybridDecision:
    mode: str  # off | auto | on
    enabled: bool
    link: float  # experts/s over the link (0 when not measured)
    cpu: float  # experts/s computed on the CPU
    source: str  # where the rates come from
    reason: str
    slope: float = 0.0  # each token past an expert's first costs the CPU this many 1-token experts

    def describe(self) -> str:
        q = self.link / (self.link + self.cpu) if self.link + self.cpu > 0 else 1.0
        return (f"split {self.mode}: hybrid {'on' if self.enabled else 'off'} ({self.reason}); "
                f"link {self.link:,.0f} experts/s, CPU {self.cpu:,.0f} experts/s (+{self.slope:.2f} per extra token), "
                f"fetch share at 1 token {q:.2f}; "
                f"rates {self.source}")

    def as_dict(self) -> dict:
        return {"mode": self.mode, "enabled": self.enabled, "link_experts_per_s": self.link,
                "cpu_experts_per_s": self.cpu, "cpu_token_slope": self.slope, "source": self.source, "reason": self.reason}


def rates(cal: Calibration, cuda: bool) -> tuple[float, float, str]:
    """(r_link, r_cpu, which) for the split: on CUDA the rates measured running together when the
    calibration has them, else each alone; on the CPU device the link is a host copy."""
    if not cuda:
        return cal.host_copy.experts_per_s, cal.cpu_compute.experts_per_s, "alone (the device is the CPU)"
    if cal.overlapped is not None:
        return cal.overlapped["link"].experts_per_s, cal.overlapped["cpu"].experts_per_s, "measured together"
    if cal.h2d is None:
        raise ValueError("the calibration has no host -> device rate: measure it with `ferryman bench bw` on this machine")
    return cal.h2d.experts_per_s, cal.cpu_compute.experts_per_s, "measured alone"


def slope_of(cal: Calibration) -> float:
    """The calibration's per-token slope (0 for files written before it was measured)."""
    if cal.cpu_tokens is None:
        return 0.0
    return token_slope(cal.cpu_compute.experts_per_s, cal.cpu_tokens.experts_per_s)


def decide(mode: str, r_link: float, r_cpu: float, source: str, slope: float = 0.0) -> HybridDecision:
    if mode not in SPLIT_MODES:
        raise ValueError(f"the split mode must be one of {', '.join(SPLIT_MODES)}, got {mode!r}")
    if mode == "off":
        return HybridDecision(mode, False, r_link, r_cpu, source, "off", slope)
    if mode == "on":
        return HybridDecision(mode, True, r_link, r_cpu, source, "forced", slope)
    pays = r_cpu >= MIN_CPU_SHARE * r_link
    why = f"CPU rate {'>=' if pays else '<'} {MIN_CPU_SHARE} x link rate"
    return HybridDecision(mode, pays, r_link, r_cpu, source, why, slope)


@dataclass
class ReuseHistory:
    """How recently and often each (layer, expert) was used: a value that gains 1 per use and
    halves every `half_life` engine steps (the CRF of policies.LRFUPolicy, over used experts)."""

    half_life: float = 16.0
    now: int = 0
    last: dict[tuple[int, int], int] = field(default_factory=dict)
    crf: dict[tuple[int, int], float] = field(default_factory=dict)

    def advance(self) -> None:
        self.now += 1

    def score(self, key: tuple[int, int]) -> float:
        if key not in self.crf:
            return 0.0
        return self.crf[key] * 2.0 ** (-(self.now - self.last[key]) / self.half_life)

    def use(self, keys: list[tuple[int, int]]) -> None:
        for key in keys:
            self.crf[key], self.last[key] = 1.0 + self.score(key), self.now


@dataclass
class SplitCounters:
    steps: int = 0  # layer steps that sent at least one miss to the CPU
    fetched: int = 0  # misses fetched in split-eligible layer steps
    cpu: int = 0  # misses computed on the CPU


class HybridSplit:
    """Per layer step: which misses to fetch, which to compute on the CPU."""

    def __init__(self, decision: HybridDecision, max_tokens: int = MAX_SPLIT_TOKENS, min_cpu: int | None = None) -> None:
        self.decision, self.max_tokens = decision, max_tokens
        # the CPU's rate as the engine sees it (1-token experts/s): the calibrated one, moved by each
        # finished CPU job (`observe`), and drawn back to the calibration a little each step (`advance`)
        self.cpu_rate = decision.cpu
        self.observed = 0  # CPU jobs observed
        self.min_cpu = max(1, MIN_CPU if min_cpu is None else min_cpu)
        self.history = ReuseHistory()
        self.counters = SplitCounters()
        # auto: decode steps timed with the split and without decide whether it stays (split_trial.py)
        self.trial = SplitTrial() if decision.mode == "auto" and decision.enabled else None

    @property
    def active(self) -> bool:
        """Whether the coming step splits: the decision's, and under auto the trial's current window."""
        return self.decision.enabled and (self.trial is None or self.trial.on)

    def applies(self, tokens: int, streaming: bool) -> bool:
        return self.active and not streaming and tokens <= self.max_tokens

    def note_step(self, seconds: float, batch: int, decode_only: bool) -> None:
        """An engine step of `batch` sequences took `seconds` (decode_only: no prompt tokens in it):
        the trial's sample; its verdict, once in, is the decision's."""
        if self.trial is None or not self.decision.enabled:
            return
        verdict = self.trial.note(seconds, batch, decode_only)
        if verdict is None:
            return
        self.decision = replace(self.decision, enabled=verdict, reason=self.trial.reason)
        log.info("moe_strategy auto: %s", self.trial.reason)

    def split(self, layer: int, misses: list[int], room: int, device_min: int = 0,
              tokens: list[int] | None = None) -> tuple[list[int], list[int]]:
        """(fetch, cpu), both ascending; at most `room` fetched (slots not in use after the hits),
        and at least `device_min` (room allowing: the device kernel needs one slot to give the CPU's
        pairs when the layer has no hit). tokens[e]: expert e's token count in this step (1 each
        when not given), which sets what it costs the CPU."""
        ranked = self._ranked(layer, misses)
        if self.cpu_rate <= 0:
            f = len(misses)
        else:
            f = split_costs([self.units([e], tokens) / self.cpu_rate for e in ranked], self.decision.link,
                            CPU_JOB_SECONDS)
        if len(misses) - f < self.min_cpu:  # too few to pay for the CPU job's fixed cost: fetch them
            f = len(misses)
        f = min(max(f, min(device_min, len(misses))), max(0, room))
        fetch, cpu = sorted(ranked[:f]), sorted(ranked[f:])
        c = self.counters
        c.fetched += len(fetch)
        c.cpu += len(cpu)
        c.steps += int(bool(cpu))
        return fetch, cpu

    def link_share(self, layer: int, misses: list[int]) -> list[int]:
        """Of a guessed layer's misses, those its split would fetch (ranked as `split` ranks, 1 token
        each: a guess has no counts), ascending. An early decode prefetch copies only these, while
        the layer before computes; the layer's own split then shares what is left with the CPU, so
        the CPU keeps work and the link keeps busy through the gap between layers."""
        ranked = self._ranked(layer, misses)
        f = len(misses) if self.cpu_rate <= 0 else split_costs([1.0 / self.cpu_rate] * len(misses), self.decision.link,
                                                               CPU_JOB_SECONDS)
        if len(misses) - f < self.min_cpu:  # the layer's split would fetch these too (`split`)
            f = len(misses)
        return sorted(ranked[:f])

    def _ranked(self, layer: int, misses: list[int]) -> list[int]:
        """Misses most worth fetching first: the most recently and often used (ties: lower id)."""
        return sorted(misses, key=lambda e: (-self.history.score((layer, e)), e))

    def units(self, experts: list[int], tokens: list[int] | None) -> float:
        """What `experts` cost the CPU in 1-token experts: 1 + slope per token past the first."""
        return sum(1.0 + self.decision.slope * (max(1, tokens[e]) - 1) if tokens is not None else 1.0
                   for e in experts)

    def observe(self, units: float, seconds: float) -> None:
        """A CPU job of `units` (1-token experts) finished `seconds` after the split sent it (its
        copy of x, preparation and hand-off included): move the rate the split uses, an exponential
        average over about 1 / OBSERVE_WEIGHT jobs: beside a busy server the CPU computes below
        the rate `ferryman bench bw` measured, and the split's balance must follow."""
        if units <= 0 or seconds <= 0:
            return
        self.cpu_rate += OBSERVE_WEIGHT * (units / seconds - self.cpu_rate)
        self.observed += 1
        self._fall_back()

    def _fall_back(self) -> None:
        """auto: stop splitting (plain offload from then on) once the CPU, after FALLBACK_JOBS jobs,
        runs more than 1 - FALLBACK_SHARE below the rate the split was predicted with: the split's
        balance is then wrong, and with a CPU that slow the link alone is not slower."""
        d = self.decision
        if d.mode != "auto" or not d.enabled or self.observed < FALLBACK_JOBS:
            return
        if self.cpu_rate < FALLBACK_SHARE * d.cpu:
            self.decision = replace(d, enabled=False, reason=f"fell back to offload: the CPU ran "
                                    f"{self.cpu_rate:,.0f} experts/s, under {FALLBACK_SHARE} x the predicted {d.cpu:,.0f}")
            log.warning("moe_strategy auto: %s", self.decision.reason)

    def advance(self) -> None:
        """A new engine step: age the reuse history, and draw the CPU rate back toward the
        calibrated one by RELAX_PER_STEP, so a split that stopped sending work to a CPU measured
        slow (no jobs, no observations) tries it again later."""
        self.history.advance()
        self.cpu_rate += RELAX_PER_STEP * (self.decision.cpu - self.cpu_rate)

    def stats(self) -> dict:
        c = self.counters
        trial = None if self.trial is None else self.trial.as_dict()
        return {"hybrid": self.decision.as_dict(), "split_steps": c.steps, "split_trial": trial,
                "cpu_experts_per_s_observed": self.cpu_rate if self.observed else None,
                "split_fetch_ratio": c.fetched / (c.fetched + c.cpu) if c.fetched + c.cpu else None}


def make_hybrid(mode: str, cache: "ExpertCache", act: MoEActivation,
                calibration: str | Path | None = None) -> HybridSplit | None:
    """None for "off"; else the split with rates from the calibration file for this model's experts
    on this machine, or measured now in a few hundred ms on the engine's own store and slots."""
    if mode not in SPLIT_MODES:
        raise ValueError(f"the split mode must be one of {', '.join(SPLIT_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    if mode == "auto" and cache.device.type != "cuda":
        log.info("moe_strategy auto: no split (the device is the CPU: its slots and the host store share one memory)")
        return None
    key = expert_key(cache.store.cfg, cache.store.dtype)
    cal, why = load_matching(key, Path(calibration) if calibration is not None else None)
    if cal is None:
        if cache.table.slot_of:
            raise RuntimeError("the quick calibration copies into the cache's slots: run it before any expert is cached")
        k = min(cache.store.cfg.top_k, cache.table.num_slots)
        cal = quick_calibration(cache.store, slot_copy_rep(cache, k), k, cache.device, act, overlap_share=MIN_CPU_SHARE)
        why += "; measured quickly at start (`ferryman bench bw` measures carefully)"
    r_link, r_cpu, which = rates(cal, cache.device.type == "cuda")
    decision = decide(mode, r_link, r_cpu, f"{which}, {why}", slope_of(cal))
    log.info("%s", decision.describe())
    return HybridSplit(decision)


def slot_copy_rep(cache: "ExpertCache", k: int) -> Rep:
    """k experts copied into the first k slots through the cache's own copy path, slots in reverse
    order so that no copies coalesce, as with scattered misses."""
    store, layers = cache.store, cache.store.cfg.moe_layers
    cycle = ExpertCycle(len(layers), cache.num_experts, k)

    def rep() -> None:
        pool, ids = cycle.next()
        for c in cache.pool.copies(store, layers[pool], list(zip(ids, reversed(range(k))))):
            c.dst.copy_(c.src, non_blocking=True)
        sync(cache.device)

    return rep
