"""Guessing the next MoE layer's experts, and deciding where acting on the guess pays.

While layer L computes, layer L+1's router applied to layer L's MoE input guesses which experts
L+1 will use (its real input differs by one attention block and a residual add). The guess for
a decode step (few tokens) is a handful of experts; for a prefill chunk it is the union over the
chunk, most of the layer: prefetching it is the prefill double buffering (while L computes,
L+1's experts stream into slots not in use).

Accounting per target layer, decode steps only (prefill unions are near-certain):
- recall: how many of the experts a layer used had been guessed (|guess & used| / |used|);
- precision of the prefetch: of the experts copied on a guess, how many the layer then used.
A prefetch never saves bytes: a right one moves a copy earlier (behind compute), a wrong one adds
a copy on the link and may evict an expert that would have hit. So it pays only when the guess is
mostly right. Prefetch to a layer stops once `min_samples` guessed copies show a precision below
`min_precision` (0.75), and stays off. (At the first default, 0.5, the weak guesses on
random-routing gpt-oss-20b weights stayed on and decode got slower: docs/benchmarks.md.)
Decode prefetch (`decode`, FERRYMAN_DECODE_PREFETCH) is `early` by default, in decode steps of at
most FERRYMAN_DECODE_PREFETCH_MAX_SEQS sequences (OffloadExperts._guesses; 0: DECODE_MAX_SEQS):
on the H200, in one engine with the modes in turn, gpt-oss-20b decoded one sequence at 53.0 against
49.2 tok/s off (precision 0.79-0.82), -120b at 23.4 against 21.9; 16 users (prefills mixed in)
115.3 against 112.3 once the cache kept a stable core (policies.py, admission), guesses precise to
0.94; with the hybrid split too, 116.5 against 109.1 with guesses up to 4 sequences (before
admission the guesses had left the CPU idle: docs/benchmarks.md, sessions 12 and 13). Prefill
streaming is on either way. The late guess (`guess_residual`) reads a closer input and is issued
right after this layer's MoE kernel, so its copies cover the next attention, router and host
sync, the window in which the link idles.
Gap guesses (`gap_k`, FERRYMAN_DECODE_GAP_GUESS, default 1): in a
one-sequence decode step, a layer whose full guess the precision gate turned off still gets the
first `gap_k` uncached experts of the guess copied, most likely first (OffloadExperts._prefetch). Those copies start behind this
layer's demand copies and fill the window in which the link otherwise idles (this layer's kernel,
the next attention, router, host sync and lookup: ~200-350 µs, about one expert's copy on a
PCIe 5.0 link). A right one takes its copy off the next layer's critical path; a wrong one delays
the next layer's demand copies only by what overruns the window. So they pay at a precision far
below the full guess's bar: a layer's gap guesses stop below `min_gap_precision` (0.25). On the
H200 (session 14), one gap copy per layer: gpt-oss-120b at 16 GiB 27.8 against 25.5 tok/s, -20b at
8 GiB 59.3 against 51.5; two copies were no better on -20b (57.6).
Wrap guesses (`wrap`, FERRYMAN_DECODE_WRAP_GUESS, default on): the last MoE layer of a decode step
copies what the first MoE layer used in it, for the next step (the same sequences' next tokens);
those copies fill the link's idle time between steps (sampling, scheduling, the first attention).
16 users in one process on the H200 (session 14): 122.5 against 120.4 tok/s.
One-sequence guesses copy `narrow_k` (half the top-k) of their experts, most likely first; the
rest is graded without a copy and joins a layer's copies once it is right `tail_bar` (0.85) of
the time (`copy_width`): on the H200 (session 16) gpt-oss-120b decoded 30.2 against 27.6 tok/s
copying all 4, -20b 61.6 against 59.5.
The precision gate grades one-sequence steps, small batches and wide ones apart (`counters`,
`batch_counters`, `wide_counters`), and a gate that turned a layer off opens again for a new trial
after `reprobe_after` (512) steps of the layer.
`late2` also guesses the layer after next and holds those experts until used (experts/late_guess.py).
Session 10 on the H200 (docs/benchmarks.md): late ~ off on gpt-oss-20b, late2 slower there and
slightly faster on -120b; both stay opt-in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ferryman.errors import ConfigError


DECODE_MODES = ("off", "early", "late", "late2")
DECODE_MAX_SEQS = 16  # early guesses up to this batch (FERRYMAN_DECODE_PREFETCH_MAX_SEQS=0)
WIDE_BATCH = 8  # steps of at least this many sequences have their own precision gate


@dataclass
class GuessCounters:
    recall_hit: int = 0  # used experts that had been guessed
    recall_total: int = 0  # used experts (decode steps that had a guess)
    fetched: int = 0  # experts copied on a full guess (decode steps)
    useful: int = 0  # of those, used by the layer
    enabled: bool = True  # full guesses (the precision gate)
    gap_fetched: int = 0  # experts copied on a gap guess (the full guess off)
    gap_useful: int = 0
    gap_enabled: bool = True
    off_steps: int = 0  # steps of the layer since the gate turned its full guesses off (re-probe)
    tail_guessed: int = 0  # one-sequence guesses' experts past the narrow width (graded, copied or not)
    tail_used: int = 0  # of those, used by the layer


def narrow_k(top_k: int) -> int:
    """The narrow width of a one-sequence guess: half the model's top-k from top-4 up (measured
    on gpt-oss, top-4: docs/benchmarks.md, session 16), else top-k (a top-2 model's guess of one
    expert is not measured)."""
    return top_k // 2 if top_k >= 4 else top_k


@dataclass
class NextLayerGuesser:
    gates: dict[int, nn.Module]  # MoE layer -> its router (a [H] -> [E] linear map)
    top_k: int
    min_precision: float = 0.75
    min_samples: int = 32
    # a gate that turned a layer's guesses off opens again for a new trial after this many steps of
    # the layer: grades from a few early steps (one user, then a small burst) must not decide a
    # whole run whose traffic changed
    reprobe_after: int = 512
    # decode steps: off | early (the next router on this layer's MoE input, while this layer's
    # misses copy) | late (the next layer's norm + router on the residual after this layer's MoE,
    # `guess_residual`; per-layer graph decode only) | late2 (late, for the next two MoE layers: their
    # copies are held until their layer runs, so the link always has the next layer's experts
    # queued). offload_backend: FERRYMAN_DECODE_PREFETCH
    decode: str = "early"
    # experts per token an early decode guess takes (0: top_k): wider guesses trade precision for
    # recall, and the precision gate scales with them. offload_backend: FERRYMAN_DECODE_PREFETCH_TOPK
    decode_k: int = 0
    # experts per token a one-sequence early decode guess copies (0: adaptive, per layer). A
    # one-sequence step is link-bound: a right guess only moves a copy earlier, a wrong one adds
    # its whole time. gpt-oss-120b at 16 GiB (H200, session 16) decoded 30.9 tok/s copying 2 of
    # top-4 against 29.1 copying 4, though the 3rd and 4th guesses were right about 0.7 of the
    # time. Adaptive: copy the `narrow_k` most likely, the rest of guess_k too once the layer's
    # graded tail (computed anyway, copied or not) is right at least `tail_bar` of the time.
    # offload_backend: FERRYMAN_DECODE_PREFETCH_SOLO_TOPK
    solo_k: int = 0
    tail_bar: float = 0.85
    # early decode guesses only in steps of at most this many sequences (0: DECODE_MAX_SEQS).
    # offload_backend: FERRYMAN_DECODE_PREFETCH_MAX_SEQS
    decode_max_seqs: int = 0
    # one-sequence decode steps: experts a gap guess copies where the full guess is off (0: none).
    # offload_backend: FERRYMAN_DECODE_GAP_GUESS
    gap_k: int = 0
    min_gap_precision: float = 0.25
    # decode steps of <= decode_max_seqs sequences: the last MoE layer also guesses the first for
    # the next step, the experts it used in this one (`wants_wrap`). offload_backend: FERRYMAN_DECODE_WRAP_GUESS
    wrap: bool = False
    norms: dict[int, nn.Module] = field(default_factory=dict)  # MoE layer -> its router's input norm (late)
    next_of: dict[int, int] = field(init=False)
    # the precision gate's grades, per layer: `counters` of one-sequence steps, `batch_counters` of
    # steps of 2 to WIDE_BATCH - 1 sequences, `wide_counters` of wider ones. The union of a batch's
    # guesses is more often right the wider the batch (16 users on the H200: 0.92-0.95 in every
    # layer), so a gate narrow steps turned off stays on for wide ones (session 14: a 1-sequence
    # warm-up had turned 10 of 23 layers off for a 16-user serve; session 16: a 4-user load had
    # turned 7 of 23 off for the 16 users after it, 118 against 129 tok/s)
    counters: dict[int, GuessCounters] = field(init=False)
    batch_counters: dict[int, GuessCounters] = field(init=False)
    wide_counters: dict[int, GuessCounters] = field(init=False)
    # layer -> (guessed, fetched, the sequences of the guess's step)
    pending: dict[int, tuple[set[int], set[int], int]] = field(init=False)
    gap_pending: dict[int, set[int]] = field(init=False)  # layer -> experts a gap guess copied
    tail_pending: dict[int, list[int]] = field(init=False)  # layer -> a one-sequence guess's uncopied tail

    def __post_init__(self) -> None:
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode prefetch must be one of {', '.join(DECODE_MODES)}, got {self.decode!r}")
        if self.gap_k < 0:
            raise ConfigError(f"FERRYMAN_DECODE_GAP_GUESS must be >= 0 experts (0: off), got {self.gap_k}")
        if self.decode_max_seqs < 0:
            raise ConfigError(f"FERRYMAN_DECODE_PREFETCH_MAX_SEQS must be >= 0 sequences (0: the default), "
                              f"got {self.decode_max_seqs}")
        self.decode_max_seqs = self.decode_max_seqs or DECODE_MAX_SEQS
        if self.decode_k < 0:
            raise ConfigError(f"FERRYMAN_DECODE_PREFETCH_TOPK must be >= 0 experts per token (0: top-k), got {self.decode_k}")
        if self.solo_k < 0:
            raise ConfigError(f"FERRYMAN_DECODE_PREFETCH_SOLO_TOPK must be >= 0 experts per token (0: adaptive), "
                              f"got {self.solo_k}")
        if self.late_depth and set(self.norms) != set(self.gates):
            raise ValueError("late decode prefetch needs the router-input norm of every MoE layer")
        layers = sorted(self.gates)
        self.next_of = dict(zip(layers, layers[1:]))
        self.first, self.last = layers[0], layers[-1]
        self.reset_grades()

    def reset_grades(self) -> None:
        """Forget every grade and pending guess: the precision gates start over (after a warm-up,
        whose steps are not the traffic the gates should learn from)."""
        layers = sorted(self.gates)
        targets = layers if self.wrap else layers[1:]
        self.counters = {layer: GuessCounters() for layer in targets}
        self.batch_counters = {layer: GuessCounters() for layer in targets}
        self.wide_counters = {layer: GuessCounters() for layer in targets}
        self.pending = {}
        self.gap_pending = {}
        self.tail_pending = {}

    @property
    def late_depth(self) -> int:
        """How many MoE layers ahead the late decode guess reaches (0: no late guess)."""
        return {"late": 1, "late2": 2}.get(self.decode, 0)

    def ahead(self, layer: int, depth: int) -> int | None:
        """The MoE layer `depth` after `layer`, if there is one."""
        target: int | None = layer
        for _ in range(depth):
            target = self.next_of.get(target) if target is not None else None
        return target

    @property
    def guess_k(self) -> int:
        """Experts per token of an early decode guess."""
        return self.decode_k or self.top_k

    def width(self, seqs: int) -> int:
        """Experts per token an early decode guess computes in a step of `seqs` sequences."""
        return self.solo_k if seqs == 1 and self.solo_k else self.guess_k

    def copy_width(self, layer: int) -> int:
        """Experts a one-sequence guess for `layer` copies, most likely first (`solo_k`)."""
        if self.solo_k:
            return self.solo_k
        c = self.counters[layer]
        precise = c.tail_guessed >= self.min_samples and c.tail_used >= self.tail_bar * c.tail_guessed
        return self.guess_k if precise else min(narrow_k(self.top_k), self.guess_k)

    def remember_tail(self, layer: int, tail: list[int]) -> None:
        """The one-sequence guess's experts past its copy width: graded when `layer` runs."""
        self.tail_pending[layer] = tail

    def guess(self, layer: int, x: torch.Tensor, wide: bool = False) -> tuple[int, torch.Tensor] | None:
        """(next MoE layer, guessed ids [T, k]) from layer `layer`'s MoE input x [T, H]; k is the
        model's top-k, or `width(T)` for a `wide` (decode) guess."""
        nxt = self.next_of.get(layer)
        if nxt is None:
            return None
        logits = self.gates[nxt](x)  # [T, E]; softmax is monotone, top-k on logits suffices
        k = min(self.width(x.shape[0]) if wide else self.top_k, logits.shape[-1])
        return nxt, torch.topk(logits, k, dim=-1).indices

    def guess_ahead(self, layer: int, x: torch.Tensor, depth: int) -> tuple[int, torch.Tensor] | None:
        """(the MoE layer `depth` after `layer`, guessed ids [T, K]) from layer `layer`'s MoE input:
        that layer's router on x. For a prefill chunk the union is about every expert anyway."""
        target = self.ahead(layer, depth)
        if target is None:
            return None
        return target, torch.topk(self.gates[target](x), self.top_k, dim=-1).indices

    def guess_residual(self, layer: int, residual: torch.Tensor, depth: int = 1) -> tuple[int, torch.Tensor] | None:
        """Late guess: (the MoE layer `depth` after `layer`, ids [T, K]) from the residual stream
        [T, H] after layer `layer`'s MoE: that layer's router on its own norm of it (the attention
        blocks in between are missing)."""
        target = self.ahead(layer, depth)
        if target is None:
            return None
        logits = self.gates[target](self.norms[target](residual))  # [T, E]
        return target, torch.topk(logits, self.top_k, dim=-1).indices

    def wants_prefetch(self, layer: int, streaming: bool, seqs: int = 1) -> bool:
        """Whether to guess `layer` for a step of `seqs` rows (a streaming chunk: always; the late
        guesses, computed inside the MoE graphs, pass no count and are not limited by it)."""
        return streaming or (self.decode != "off" and seqs <= self.decode_max_seqs
                             and self.counters_for(seqs)[layer].enabled)

    def counters_for(self, seqs: int) -> dict[int, GuessCounters]:
        """The precision gate's grades for steps of `seqs` sequences."""
        if seqs >= WIDE_BATCH:
            return self.wide_counters
        return self.batch_counters if seqs > 1 else self.counters

    def every_grade(self) -> list[GuessCounters]:
        """Every layer's grades of every step size."""
        return [*self.counters.values(), *self.batch_counters.values(), *self.wide_counters.values()]

    def wants_wrap(self, layer: int, seqs: int) -> bool:
        """Whether a decode step of `seqs` rows at `layer` guesses the first MoE layer of the next
        step (the experts that layer used in this one): `layer` is the last, and the wrap guesses
        keep the full guesses' precision."""
        return (self.wrap and layer == self.last and self.decode == "early" and seqs <= self.decode_max_seqs
                and self.counters_for(seqs)[self.first].enabled)

    def wants_gap(self, layer: int, seqs: int) -> bool:
        """Whether a one-sequence decode step guesses `layer`'s `gap_k` most likely experts: the
        full guess is off there (precision gate) and the gap guesses have not been graded useless."""
        c = self.counters[layer]
        return (self.gap_k > 0 and seqs == 1 and self.decode == "early" and not c.enabled and c.gap_enabled)

    def remember_gap(self, layer: int, fetched: list[int]) -> None:
        """The experts a gap guess for `layer` copied, to grade when it runs."""
        self.gap_pending.setdefault(layer, set()).update(fetched)

    def remember(self, layer: int, guessed: list[int], fetched: list[int], streaming: bool, seqs: int = 1) -> None:
        """What was guessed (and copied) for `layer` in a decode step of `seqs` sequences, to score
        when it runs; a second guess for the same layer (late2: two layers ahead, then one) adds to
        the first."""
        if not streaming:
            old_guessed, old_fetched, _ = self.pending.get(layer, (set(), set(), 1))
            self.pending[layer] = (old_guessed | set(guessed), old_fetched | set(fetched), seqs)

    def score(self, layer: int, used: list[int], seqs: int = 0) -> None:
        """`layer` runs with experts `used` in a decode step of `seqs` sequences (0: a prefill
        chunk): grade the guess made for it, if any; a step without one counts toward re-probing
        a gate that is off."""
        gap = self.gap_pending.pop(layer, None)
        if gap is not None:
            c = self.counters[layer]
            c.gap_fetched += len(gap)
            c.gap_useful += len(gap.intersection(used))
            if c.gap_enabled and c.gap_fetched >= self.min_samples and c.gap_useful < self.min_gap_precision * c.gap_fetched:
                c.gap_enabled = False
        tail = self.tail_pending.pop(layer, None)
        if tail is not None:
            self.counters[layer].tail_guessed += len(tail)
            self.counters[layer].tail_used += len(set(tail).intersection(used))
        guessed, fetched, rows = self.pending.pop(layer, (None, set(), 1))
        if guessed is None:
            self._tick_off(layer, seqs)
            return
        c = self.counters_for(rows)[layer]
        c.recall_hit += len(guessed.intersection(used))
        c.recall_total += len(used)
        c.fetched += len(fetched)
        c.useful += len(fetched.intersection(used))
        # a guess of w experts per token for top_k used: its precision bar scales down with w > top_k
        width = self.guess_k if rows > 1 else self.copy_width(layer)
        bar = self.min_precision * self.top_k / max(self.top_k, width)
        if c.enabled and c.fetched >= self.min_samples and c.useful < bar * c.fetched:
            c.enabled = False

    def _tick_off(self, layer: int, seqs: int) -> None:
        """One more decode step of `layer` without a guess; `reprobe_after` of them open its gate
        again with fresh grades (recall stays cumulative)."""
        c = self.counters_for(seqs).get(layer) if seqs > 0 else None
        if c is None or c.enabled:
            return
        c.off_steps += 1
        if c.off_steps >= self.reprobe_after:
            c.enabled, c.fetched, c.useful, c.off_steps = True, 0, 0, 0

    def stats(self) -> dict:
        """Per layer: one-sequence steps' recall / precision / gate, small and wide batches'
        precision / gate, gap guesses' and uncopied tails' precision; the recall over every graded
        guess."""
        ratio = lambda a, b: a / b if b else None  # noqa: E731
        rows = {layer: {"recall": ratio(c.recall_hit, c.recall_total), "precision": ratio(c.useful, c.fetched),
                        "prefetch": self.decode != "off" and c.enabled,
                        "batch_precision": ratio(b.useful, b.fetched),
                        "batch_prefetch": self.decode != "off" and b.enabled,
                        "wide_precision": ratio(w.useful, w.fetched),
                        "wide_prefetch": self.decode != "off" and w.enabled,
                        "gap_precision": ratio(c.gap_useful, c.gap_fetched),
                        "tail_precision": ratio(c.tail_used, c.tail_guessed)}
                for (layer, c), b, w in zip(self.counters.items(), self.batch_counters.values(),
                                            self.wide_counters.values())}
        every = self.every_grade()
        hit, total = sum(c.recall_hit for c in every), sum(c.recall_total for c in every)
        return {"guess_recall": ratio(hit, total), "per_layer_guess": rows}
