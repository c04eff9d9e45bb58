"""The decode guesses' precision gates (experts/guesses.py): graded per step width (one
sequence, small batches, wide ones), re-probed after a while, their bar scaled with the guess
width; and a one-sequence guess's adaptive copy width."""

from __future__ import annotations

import torch

from ferryman.experts.guesses import NextLayerGuesser
from test_expert_cache import FixedGate


def test_a_gate_that_turned_off_opens_again_for_a_new_trial() -> None:
    gates = {0: FixedGate([0, 1]), 1: FixedGate([5, 6])}
    g = NextLayerGuesser(gates, top_k=2, min_samples=4, reprobe_after=6)
    for _ in range(2):  # a small burst whose guesses were wrong: the batch gate turns layer 1 off
        g.remember(1, [5, 6], [5, 6], streaming=False, seqs=3)
        g.score(1, [2, 3], seqs=3)
    assert not g.wants_prefetch(1, False, seqs=4)
    for _ in range(5):  # decode steps without a guess
        g.score(1, [5, 6], seqs=4)
    g.score(1, [5, 6], seqs=0)  # a prefill chunk does not count
    assert not g.wants_prefetch(1, False, seqs=4)
    g.score(1, [5, 6], seqs=4)  # the sixth: a new trial with fresh grades
    c = g.batch_counters[1]
    assert g.wants_prefetch(1, False, seqs=4) and c.fetched == 0 and c.off_steps == 0
    assert g.counters[1].enabled  # one-sequence steps were never graded: untouched


def test_small_batches_do_not_turn_wide_batches_off() -> None:
    """A 4-user load had turned 7 of 23 layers' batch gates off for the 16 users after it.
    Steps of 2-7 sequences and of 8 or more are graded apart."""
    gates = {0: FixedGate([0, 1]), 1: FixedGate([5, 6])}
    g = NextLayerGuesser(gates, top_k=2, min_samples=4)
    for _ in range(2):  # four sequences, wrong guesses
        g.remember(1, [5, 6], [5, 6], streaming=False, seqs=4)
        g.score(1, [2, 3], seqs=4)
    assert not g.wants_prefetch(1, False, seqs=7) and g.wants_prefetch(1, False, seqs=8)
    for _ in range(2):  # sixteen sequences, wrong too: their own gate closes
        g.remember(1, [5, 6], [5, 6], streaming=False, seqs=16)
        g.score(1, [2, 3], seqs=16)
    assert not g.wants_prefetch(1, False, seqs=16) and g.wants_prefetch(1, False, seqs=1)
    row = g.stats()["per_layer_guess"][1]
    assert (row["batch_precision"], row["wide_precision"], row["wide_prefetch"]) == (0.0, 0.0, False)


def test_precision_gate_scales_with_the_guess_width() -> None:
    from ferryman.experts.guesses import NextLayerGuesser

    gates = {0: torch.nn.Linear(4, 8), 1: torch.nn.Linear(4, 8)}
    # 16 of 32 copies used: 0.5 passes only 0.75 x 4 / 8. Batches copy top-k, one sequence solo_k
    # wide (0: at most top-k, so the plain bar)
    for solo, seqs, stays in ((0, 2, False), (8, 2, False), (0, 1, False), (8, 1, True)):
        g = NextLayerGuesser(gates, top_k=4, solo_k=solo, min_samples=32)
        for _ in range(8):
            g.remember(1, [0, 1, 2, 3], [0, 1, 2, 3], streaming=False, seqs=seqs)
            g.score(1, [0, 1], seqs=seqs)
        assert g.counters_for(seqs)[1].enabled == stays, (solo, seqs)


def test_one_sequence_guesses_copy_half_the_top_k_until_the_rest_proves_precise() -> None:
    """A one-sequence guess computes top-k but copies the top_k // 2 most likely (from top-4 up);
    the rest, graded without a copy, joins once it is right `tail_bar` of the time. Steps of
    several sequences copy top-k; solo_k fixes the width."""
    from ferryman.experts.guesses import NextLayerGuesser, narrow_k

    assert [narrow_k(k) for k in (1, 2, 4, 8)] == [1, 2, 2, 4]
    torch.manual_seed(0)
    gates = {0: torch.nn.Linear(4, 8), 1: torch.nn.Linear(4, 8)}
    g = NextLayerGuesser(gates, top_k=4, min_samples=8)
    x = torch.randn(2, 4)
    best = torch.topk(gates[1](x), 4, dim=-1).indices  # [2, 4]
    one = g.guess(0, x[:1], wide=True)
    assert one is not None and torch.equal(one[1], best[:1])  # computed at full width: the tail is graded
    assert (g.copy_width(1), g.width(2)) == (2, 4)
    for used in ([0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 6]):
        assert g.copy_width(1) == 2  # fewer than min_samples graded
        g.remember_tail(1, [2, 3])
        g.remember(1, [0, 1, 2, 3], [0, 1], streaming=False)
        g.score(1, used, seqs=1)  # tails right 2/2, 2/2, 2/2, 1/2
    assert g.copy_width(1) == 4  # 7 of 8 >= 0.85
    g.remember_tail(1, [2, 3])
    g.score(1, [0, 1], seqs=1)
    assert g.copy_width(1) == 2 and g.stats()["per_layer_guess"][1]["tail_precision"] == 0.7
    fixed = NextLayerGuesser(gates, top_k=4, solo_k=3)
    assert (fixed.width(1), fixed.copy_width(1), fixed.width(2)) == (3, 3, 4)
    fixed_one = fixed.guess(0, x[:1], wide=True)
    assert fixed_one is not None and torch.equal(fixed_one[1], best[:1, :3])
