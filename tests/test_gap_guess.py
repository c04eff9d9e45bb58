"""Gap guesses (NextLayerGuesser.gap_k, GAP_GUESS = 1): in one-sequence decode steps, layers whose full guess
the precision gate turned off still copy their first `gap_k` uncached guessed experts, most likely
first; answers stay the resident ones; the gap guesses grade themselves and stop when useless."""

from __future__ import annotations

import pytest
import torch

from ferryman import LLM
from ferryman.experts.guesses import NextLayerGuesser
from tiny_models import greedy_ids

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _guesser(gap_k: int) -> NextLayerGuesser:
    gates = {0: torch.nn.Linear(4, 8), 1: torch.nn.Linear(4, 8)}
    return NextLayerGuesser(gates, top_k=2, gap_k=gap_k, min_samples=8)


def test_gap_guesses_only_where_the_full_guess_is_off_and_one_sequence() -> None:
    g = _guesser(1)
    assert not g.wants_gap(1, seqs=1)  # the full guess is on
    g.counters[1].enabled = False
    assert g.wants_gap(1, seqs=1) and not g.wants_gap(1, seqs=2)
    off = _guesser(0)
    off.counters[1].enabled = False
    assert not off.wants_gap(1, seqs=1)
    no_prefetch = NextLayerGuesser(off.gates, top_k=2, gap_k=1, decode=False)
    no_prefetch.counters[1].enabled = False
    assert not no_prefetch.wants_gap(1, seqs=1)
    assert NextLayerGuesser(off.gates, top_k=2).gap_k == 1
    with pytest.raises(ValueError, match="gap_k=-1"):
        _guesser(-1)


@pytest.mark.parametrize("useful, stays", [(1, True), (0, False)])
def test_gap_guesses_stop_below_their_precision_bar(useful: int, stays: bool) -> None:
    """One copy per step, used in 1 of 4 steps (0.25: at the bar, kept) or never (stopped)."""
    g = _guesser(1)
    g.counters[1].enabled = False
    for step in range(12):
        g.remember_gap(1, [5])
        g.score(1, [5, 6] if step % 4 == 0 and useful else [6, 7])
    c = g.counters[1]
    assert c.gap_fetched == 12 and c.gap_useful == (3 if useful else 0)
    assert c.gap_enabled == stays
    assert g.stats()["per_layer_guess"][1]["gap_precision"] == c.gap_useful / 12


@pytest.mark.parametrize("device", DEVICES)
def test_gap_guesses_copy_at_most_gap_k_and_keep_the_answers(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = dict(device=device, dtype="float32", max_num_batched_tokens=32)
    prompts = [[5, 6, 7, 8, 9]]
    want = greedy_ids(LLM(**kw), prompts, 16)
    llm = LLM(moe_strategy="offload", expert_cache="10%", decode_misses="copy", **kw)  # link steps guess nothing
    experts = llm.engine.runner.experts
    assert experts.guesser.gap_k == 1
    for c in experts.guesser.counters.values():  # as if the precision gate had turned every full guess off
        c.enabled = False
    sizes: list[int] = []
    inner = experts.cache.prefetch

    def prefetch(layer: int, ids: list[int], *args, **kwargs) -> list[int]:  # noqa: ANN002, ANN003
        sizes.append(len(ids))
        return inner(layer, ids, *args, **kwargs)

    monkeypatch.setattr(experts.cache, "prefetch", prefetch)
    assert greedy_ids(llm, prompts, 16) == want
    decode_sizes = sizes[-8:]  # the last decode steps' guesses (the prefill streams whole layers)
    assert decode_sizes and max(decode_sizes) <= 1, sizes
    gap = sum(c.gap_fetched for c in experts.guesser.counters.values())
    assert gap > 0
    assert all(not c.fetched for c in experts.guesser.counters.values())  # no full guess was copied
