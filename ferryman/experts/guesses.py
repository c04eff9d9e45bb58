"""Guessing the next MoE layer's experts, and grading where acting on the guess pays.

While layer L computes, layer L+1's router applied to layer L's MoE input guesses which experts
L+1 will use (its real input differs by one attention block and a residual add). For a prefill
chunk the guess is the union over the chunk, most of the layer: copying it is the prefill double
buffering (while L computes, L+1's experts stream into slots not in use).

A decode prefetch never saves bytes: a right guess moves a copy earlier (behind compute), a wrong
one adds a copy on the link and may evict an expert that would have hit. So each decode guess is
graded when its layer runs (`score`), and a precision gate turns a layer's guesses off below
`min_precision` once `min_samples` copies were graded; it opens again after `reprobe_after` steps
of the layer. One-sequence steps, small batches and wide batches have gates of their own (a wide
batch's union of guesses is right far more often). Kinds of decode guess (experts/plan.py):
- full: the next layer's guess, in steps of at most `decode_max_seqs` sequences; a one-sequence
  guess copies its `copy_width` most likely experts, the rest is graded without a copy (its tail);
- gap: one-sequence steps, where the full guess is off: the `gap_k` most likely uncached experts,
  graded on their own bar (`min_gap_precision`): their copies fill the link's idle window;
- wrap: the last MoE layer copies what the first used in this step, for the next step.
Measurements behind these defaults: docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

DECODE_MAX_SEQS = 16  # decode guesses in steps of at most this many sequences
WIDE_BATCH = 8  # steps of at least this many sequences have their own precision gate
GAP_GUESS = 1  # experts a gap guess copies
Proposal = tuple[int, str, torch.Tensor]  # (target MoE layer, kind, guessed ids [T, k] on the device)


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
    """The narrow width of a one-sequence guess: half the model's top-k from top-4 up, else top-k."""
    return top_k // 2 if top_k >= 4 else top_k


@dataclass
class NextLayerGuesser:
    # MoE layer -> its router's choice scores ([T, H] -> [T, E]: top-k of them is the layer's choice,
    # groups aside; a softmax router's logits, a sigmoid router's biased scores)
    gates: dict[int, Callable[[torch.Tensor], torch.Tensor]]
    top_k: int
    min_precision: float = 0.75
    min_samples: int = 32
    # a gate that turned a layer's guesses off opens again for a new trial after this many steps of
    # the layer: grades from a few early steps must not decide a whole run whose traffic changed
    reprobe_after: int = 512
    decode: bool = True  # act on guesses in decode steps (OffloadConfig.decode_prefetch)
    # experts a one-sequence guess copies (0: adaptive, `copy_width`): the `narrow_k` most likely,
    # the rest too once the layer's graded tail is right at least `tail_bar` of the time
    solo_k: int = 0
    tail_bar: float = 0.85
    decode_max_seqs: int = DECODE_MAX_SEQS
    gap_k: int = GAP_GUESS
    min_gap_precision: float = 0.25
    next_of: dict[int, int] = field(init=False)
    # the precision gate's grades, per layer: `counters` of one-sequence steps, `batch_counters` of
    # steps of 2 to WIDE_BATCH - 1 sequences, `wide_counters` of wider ones
    counters: dict[int, GuessCounters] = field(init=False)
    batch_counters: dict[int, GuessCounters] = field(init=False)
    wide_counters: dict[int, GuessCounters] = field(init=False)
    # layer -> (guessed, fetched, the sequences of the guess's step)
    pending: dict[int, tuple[set[int], set[int], int]] = field(init=False)
    gap_pending: dict[int, set[int]] = field(init=False)  # layer -> experts a gap guess copied
    tail_pending: dict[int, list[int]] = field(init=False)  # layer -> a one-sequence guess's uncopied tail
    first_used: list[int] | None = field(init=False, default=None)  # the first MoE layer's experts this step

    def __post_init__(self) -> None:
        if self.gap_k < 0 or self.solo_k < 0 or self.decode_max_seqs < 1:
            raise ValueError(f"guess widths must be >= 0 and decode_max_seqs >= 1, got gap_k={self.gap_k}, "
                             f"solo_k={self.solo_k}, decode_max_seqs={self.decode_max_seqs}")
        layers = sorted(self.gates)
        self.next_of = dict(zip(layers, layers[1:]))
        self.first, self.last = layers[0], layers[-1]
        self.reset_grades()

    def reset_grades(self) -> None:
        """Forget every grade and pending guess: the precision gates start over (after a warm-up,
        whose steps are not the traffic the gates should learn from)."""
        layers = sorted(self.gates)
        self.counters = {layer: GuessCounters() for layer in layers}
        self.batch_counters = {layer: GuessCounters() for layer in layers}
        self.wide_counters = {layer: GuessCounters() for layer in layers}
        self.pending = {}
        self.gap_pending = {}
        self.tail_pending = {}

    def width(self, seqs: int) -> int:
        """Experts per token a decode guess computes in a step of `seqs` sequences."""
        return self.solo_k if seqs == 1 and self.solo_k else self.top_k

    def copy_width(self, layer: int) -> int:
        """Experts a one-sequence guess for `layer` copies, most likely first (`solo_k`)."""
        if self.solo_k:
            return self.solo_k
        c = self.counters[layer]
        precise = c.tail_guessed >= self.min_samples and c.tail_used >= self.tail_bar * c.tail_guessed
        return self.top_k if precise else narrow_k(self.top_k)

    def copy_limit(self, target: int, kind: str, rows: int) -> int | None:
        """How many of a guess's experts to copy: a gap guess's `gap_k`, a one-sequence full
        guess's `copy_width`; None: all of them."""
        if kind == "gap":
            return self.gap_k
        return self.copy_width(target) if kind == "full" and rows == 1 else None

    def remember_tail(self, layer: int, tail: list[int]) -> None:
        """The one-sequence guess's experts past its copy width: graded when `layer` runs."""
        self.tail_pending[layer] = tail

    def guess(self, layer: int, x: torch.Tensor, wide: bool = False) -> tuple[int, torch.Tensor] | None:
        """(next MoE layer, guessed ids [T, k]) from layer `layer`'s MoE input x [T, H]; k is the
        model's top-k, or `width(T)` for a `wide` (decode) guess."""
        nxt = self.next_of.get(layer)
        if nxt is None:
            return None
        logits = self.gates[nxt](x)  # [T, E] choice scores
        k = min(self.width(x.shape[0]) if wide else self.top_k, logits.shape[-1])
        return nxt, torch.topk(logits, k, dim=-1).indices

    def propose(self, layer: int, x: torch.Tensor, streaming: bool) -> list[Proposal]:
        """The guess layer `layer` makes from its MoE input x [T, H] (router launches, no sync):
        the next layer's, a prefill chunk's ("stream"), a decode step's ("full"), or where the
        gate turned the full guess off, a one-sequence "gap" guess; none otherwise."""
        nxt, rows = self.next_of.get(layer), x.shape[0]
        if nxt is None:
            return []
        if self.wants_prefetch(nxt, streaming, rows):
            kind = "stream" if streaming else "full"
        elif not streaming and self.wants_gap(nxt, rows):
            kind = "gap"
        else:
            return []  # no router launch, nothing more to read back
        guess = self.guess(layer, x, wide=kind == "full")
        assert guess is not None  # nxt exists
        return [(nxt, kind, guess[1])]

    def wrap(self, layer: int, used: list[int], rows: int, streaming: bool) -> list[int] | None:
        """Decode steps: remember what the first MoE layer used; at the last, the wrap guess for
        the next step's first layer (the same sequences' next tokens), or None."""
        if layer == self.first:
            self.first_used = None if streaming else used
        elif not streaming and self.first_used and self.wants_wrap(layer, rows):
            return list(self.first_used)
        return None

    def wants_prefetch(self, layer: int, streaming: bool, seqs: int = 1) -> bool:
        """Whether to guess `layer` for a step of `seqs` rows (a streaming chunk: always)."""
        return streaming or (self.decode and seqs <= self.decode_max_seqs and self.counters_for(seqs)[layer].enabled)

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
        return (layer == self.last and self.decode and seqs <= self.decode_max_seqs
                and self.counters_for(seqs)[self.first].enabled)

    def wants_gap(self, layer: int, seqs: int) -> bool:
        """Whether a one-sequence decode step guesses `layer`'s `gap_k` most likely experts: the
        full guess is off there (precision gate) and the gap guesses have not been graded useless."""
        c = self.counters[layer]
        return self.gap_k > 0 and seqs == 1 and self.decode and not c.enabled and c.gap_enabled

    def remember_gap(self, layer: int, fetched: list[int]) -> None:
        """The experts a gap guess for `layer` copied, to grade when it runs."""
        self.gap_pending.setdefault(layer, set()).update(fetched)

    def remember(self, layer: int, guessed: list[int], fetched: list[int], streaming: bool, seqs: int = 1) -> None:
        """What was guessed (and copied) for `layer` in a decode step of `seqs` sequences, to score
        when it runs; a second guess for the same layer adds to the first."""
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
        width = self.top_k if rows > 1 else self.copy_width(layer)
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
                        "prefetch": self.decode and c.enabled,
                        "batch_precision": ratio(b.useful, b.fetched),
                        "batch_prefetch": self.decode and b.enabled,
                        "wide_precision": ratio(w.useful, w.fetched),
                        "wide_prefetch": self.decode and w.enabled,
                        "gap_precision": ratio(c.gap_useful, c.gap_fetched),
                        "tail_precision": ratio(c.tail_used, c.tail_guessed)}
                for (layer, c), b, w in zip(self.counters.items(), self.batch_counters.values(),
                                            self.wide_counters.values())}
        every = self.every_grade()
        hit, total = sum(c.recall_hit for c in every), sum(c.recall_total for c in every)
        return {"guess_recall": ratio(hit, total), "per_layer_guess": rows}
