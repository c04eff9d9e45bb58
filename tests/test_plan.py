"""The offload step as data (experts/plan.py): plans built from a fake cache state, asserted exactly
(hits, fetches, the CPU's misses, prefetches and their order), and the executor carrying plans out
on the CPU as a fake device, in the order of transfer calls the GPU path keeps."""

from __future__ import annotations

import pytest
import torch

from ferryman.experts.gpu_cache import ExpertCache
from ferryman.experts.guesses import NextLayerGuesser
from ferryman.experts.offload import OffloadExperts
from ferryman.experts.plan import Guess, LayerPlan, Prefetch, make_plan
from ferryman.experts.policies import LRUPolicy
from ferryman.layers.fused_moe import MoEActivation
from test_expert_cache import FixedGate, RecordingTransfer, make_routing, make_store


def test_plan_splits_used_experts_into_hits_and_fetches() -> None:
    plan = make_plan(3, rows=2, streaming=False, used=[1, 4, 6, 7], cached={4, 7, 9}, available=8, cpu=None,
                     guesses=[])
    assert plan == LayerPlan(3, 2, False, hits=(4, 7), fetch=(1, 6), cpu=(), prefetch=(), rounds=False)
    assert plan.device == [1, 4, 6, 7]


def test_plan_sends_the_splits_misses_to_the_cpu() -> None:
    plan = make_plan(0, rows=1, streaming=False, used=[2, 3, 5, 8], cached={3}, available=2, cpu=[8, 5],
                     guesses=[])
    assert (plan.hits, plan.fetch, plan.cpu, plan.rounds) == ((3,), (2,), (5, 8), False)
    assert plan.device == [2, 3]
    every = make_plan(0, rows=1, streaming=False, used=[2, 5], cached=set(), available=0, cpu=[2, 5], guesses=[])
    assert every.device == [] and every.cpu == (2, 5) and not every.rounds  # the CPU computes the whole layer


def test_plan_runs_in_rounds_only_without_a_split() -> None:
    used = list(range(6))
    assert make_plan(1, 40, True, used, set(), available=4, cpu=None, guesses=[]).rounds
    assert not make_plan(1, 40, True, used, set(), available=6, cpu=None, guesses=[]).rounds
    assert not make_plan(1, 4, False, used, set(), available=4, cpu=[], guesses=[]).rounds


def test_plan_prefetches_in_order_with_their_widths() -> None:
    """A one-sequence full guess copies its head and grades its tail; a gap guess copies at most
    `width` uncached; a batch's guess and a wrap guess copy everything guessed."""
    one = make_plan(0, rows=1, streaming=False, used=[1], cached=set(), available=8, cpu=None,
                    guesses=[Guess(1, "full", (5, 2, 7, 0), width=2), Guess(0, "wrap", (1,))])
    assert one.prefetch == (Prefetch(1, "full", (5, 2), (5, 2, 7, 0), tail=(7, 0)),
                            Prefetch(0, "wrap", (1,), (1,)))
    gap = make_plan(0, rows=1, streaming=False, used=[1], cached=set(), available=8, cpu=None,
                    guesses=[Guess(1, "gap", (6, 3), width=1)])
    assert gap.prefetch == (Prefetch(1, "gap", (6, 3), (6, 3), limit=1),)
    batch = make_plan(0, rows=3, streaming=False, used=[1], cached=set(), available=8, cpu=None,
                      guesses=[Guess(1, "full", (5, 2, 7), width=None)])
    assert batch.prefetch == (Prefetch(1, "full", (5, 2, 7), (5, 2, 7)),)
    with pytest.raises(ValueError, match="guess kind"):
        make_plan(0, 1, False, [1], set(), 8, None, [Guess(1, "late", (2,))])


def _executor(slots: int, guesser: NextLayerGuesser | None = None) -> tuple[OffloadExperts, RecordingTransfer]:
    rec = RecordingTransfer()
    cache = ExpertCache(make_store(), slots, torch.device("cpu"), LRUPolicy(), rec)
    return OffloadExperts(cache, MoEActivation("silu"), guesser), rec


def test_route_plans_from_the_cache_and_the_guesser() -> None:
    """One sequence on a 3-layer model: layer 0 guesses layer 1 (its router's top-2, most likely
    first), layer 1 guesses layer 2; the last layer wraps to the first; hits are what is cached."""
    gates = {0: FixedGate([0, 1]), 1: FixedGate([5, 6]), 2: FixedGate([3, 4])}
    backend, rec = _executor(8, NextLayerGuesser(gates, top_k=2))
    x, _, w = make_routing(1, 8, 2, seed=1)
    backend.begin_step()
    plan, host = backend.route(0, x, torch.tensor([[2, 3]]), False)
    assert (plan.hits, plan.fetch, plan.cpu) == ((), (2, 3), ())
    assert [(p.target, p.kind, sorted(p.guessed)) for p in plan.prefetch] == [(1, "full", [5, 6])]
    assert host.tolist() == [[2, 3]] and rec.log == []  # planning copies nothing
    backend.forward(0, x, torch.tensor([[2, 3]]), w)
    plan, _ = backend.route(1, x, torch.tensor([[5, 7]]), False)
    assert (plan.hits, plan.fetch) == ((5,), (7,))  # 5 was prefetched by layer 0's guess
    backend.forward(1, x, torch.tensor([[5, 7]]), w)
    plan, _ = backend.route(2, x, torch.tensor([[3, 4]]), False)
    assert [(p.target, p.kind, p.experts) for p in plan.prefetch] == [(0, "wrap", (2, 3))]
    backend.end_step()


def test_executor_issues_the_plan_in_the_gpu_order() -> None:
    """Demand copies, the wait, the kernel's release, then the prefetch copies, for the eager path
    and for prepare_decode + finish_step (the CUDA-graph path) alike."""
    gates = {0: FixedGate([0, 1]), 1: FixedGate([5, 6]), 2: FixedGate([0, 1])}
    x, _, w = make_routing(1, 8, 2, seed=2)
    logs = []
    for graph in (False, True):
        backend, rec = _executor(6, NextLayerGuesser(gates, top_k=2))
        backend.begin_step()
        if graph:
            step = backend.prepare_decode(0, x, torch.tensor([[2, 3]]), w)
            assert step is not None and step.slot_ids is not None and step.slot_ids.tolist() == [[0, 1]]
            assert rec.log == [("fetch", (0, 1), True, 1), ("wait", (0, 1))]
            backend.finish_step(step)
        else:
            backend.forward(0, x, torch.tensor([[2, 3]]), w)
        backend.end_step()
        logs.append(rec.log)
        assert backend.cache.table.num_pinned == 0
    assert logs[0] == logs[1] == [("fetch", (0, 1), True, 1), ("wait", (0, 1)), ("used", (0, 1)),
                                  ("fetch", (2, 3), False, 1)]


def test_a_gap_guess_copies_its_first_uncached_expert() -> None:
    gates = {0: FixedGate([0, 1]), 1: FixedGate([5, 6])}
    guesser = NextLayerGuesser(gates, top_k=2)
    guesser.counters[1].enabled = False  # the precision gate turned layer 1's full guess off
    backend, rec = _executor(6, guesser)
    x, _, w = make_routing(1, 8, 2, seed=3)
    backend.cache.release(1, [5], backend.cache.acquire(1, [5]))  # 5 is cached already
    rec.log.clear()
    plan, _ = backend.route(0, x, torch.tensor([[2, 3]]), False)
    assert [(p.kind, p.limit) for p in plan.prefetch] == [("gap", 1)]
    backend.forward(0, x, torch.tensor([[2, 3]]), w)
    assert backend.cache.contains(1, 6) and guesser.gap_pending == {1: {6}}


def test_the_guesser_sets_each_kinds_copy_limit() -> None:
    """A gap guess copies gap_k, a one-sequence full guess its narrow width (top-4: 2) until its
    tails prove precise; a batch's, a wrap and a prefill chunk's guess copy everything."""
    g = NextLayerGuesser({0: FixedGate([0, 1]), 1: FixedGate([5, 6])}, top_k=4)
    limits = [g.copy_limit(1, kind, rows) for kind, rows in (("gap", 1), ("full", 1), ("full", 2), ("wrap", 1),
                                                             ("stream", 40))]
    assert limits == [1, 2, None, None, None]
