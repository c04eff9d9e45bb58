"""Replacement policies: exact eviction order, pins, LRFU's limits (LRU and LFU), kept history."""

from __future__ import annotations

import math
import random

import pytest

from ferryman.experts.slot_table import SlotTable
from ferryman.experts.policies import DEFAULT_POLICY, POLICIES, LRFUPolicy, LRUPolicy, ReplacementPolicy, make_policy

NONE_PINNED = lambda key: False  # noqa: E731


def _drain(policy: ReplacementPolicy, pinned=NONE_PINNED) -> list[int]:
    """Every victim in eviction order (each removed before asking for the next)."""
    out = []
    while (v := policy.victim(pinned)) is not None:
        out.append(v)
        policy.remove(v)
    return out


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_recency_order_when_every_key_is_used_once(name: str) -> None:
    p = make_policy(name)
    for key in (5, 1, 9, 3):
        p.reference([key])
        p.advance()
    assert _drain(p) == [5, 1, 9, 3]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_pinned_keys_are_skipped_and_stay(name: str) -> None:
    p = make_policy(name)
    p.reference([1, 2, 3])
    assert p.victim(lambda k: k in (1, 2)) == 3
    assert p.victim(lambda k: True) is None
    assert _drain(p, lambda k: k == 1) == [2, 3]
    assert len(p) == 1 and p.victim(NONE_PINNED) == 1


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_unreferenced_insert_goes_first(name: str) -> None:
    p = make_policy(name)
    p.reference([1, 2])
    p.advance()
    p.insert_unreferenced(7)
    assert _drain(p) == [7, 1, 2]


def test_lru_step_order_and_rereference() -> None:
    p = LRUPolicy()
    p.reference([1, 2, 3])
    p.reference([1])
    assert _drain(p) == [2, 3, 1]


def _crf(refs: list[int], now: int, h: float) -> float:
    """CRF straight from the definition: sum of 2^(-(now - t) / h) over reference times."""
    return sum(2.0 ** (-(now - t) / h) for t in refs)


@pytest.mark.parametrize("half_life", [0.5, 2.0, 8.0, 100.0])
def test_lrfu_evicts_the_smallest_crf(half_life: float) -> None:
    rng = random.Random(0)
    refs: dict[int, list[int]] = {}
    p = LRFUPolicy(half_life)
    for step in range(40):
        for key in rng.sample(range(12), 3):
            refs.setdefault(key, []).append(step)
            p.reference([key])
        p.advance()
    now = 40
    crf = {k: _crf(r, now, half_life) for k, r in refs.items()}
    order = _drain(p)
    assert sorted(order) == sorted(crf)
    got = [crf[k] for k in order]
    assert all(a <= b * (1 + 1e-9) for a, b in zip(got, got[1:])), "victims must come in increasing CRF"


def test_lrfu_frequency_beats_recency_with_a_long_half_life() -> None:
    p = LRFUPolicy(half_life=8.0)
    for _ in range(3):
        p.reference([1])
        p.advance()
    p.reference([2])  # more recent, used once
    p.advance()
    assert p.victim(NONE_PINNED) == 2
    q = LRFUPolicy(half_life=0.01)  # pure recency
    for _ in range(3):
        q.reference([1])
        q.advance()
    q.reference([2])
    q.advance()
    assert q.victim(NONE_PINNED) == 1


def _replay_victims(policy: ReplacementPolicy, trace: list[list[int]], slots: int) -> list[list[int]]:
    table = SlotTable(slots, policy)
    out = []
    for step in trace:
        policy.advance()
        look = table.acquire(step)
        out.append(look.evicted)
        table.release(step)
    return out


def test_lrfu_with_a_tiny_half_life_is_lru() -> None:
    """Without admission control (which may put a miss first in line, unlike LRU)."""
    rng = random.Random(1)
    trace = [rng.sample(range(30), 4) for _ in range(300)]
    plain = LRFUPolicy(1e-3, admit_margin=None)
    assert _replay_victims(plain, trace, 10) == _replay_victims(LRUPolicy(), trace, 10)


def test_lrfu_with_a_huge_half_life_is_lfu() -> None:
    rng = random.Random(2)
    counts: dict[int, int] = {}
    p = LRFUPolicy(half_life=1e9)
    for step in range(50):
        key = min(int(rng.expovariate(0.3)), 15)
        counts[key] = counts.get(key, 0) + 1
        p.reference([key])
        p.advance()
    victim = p.victim(NONE_PINNED)
    assert counts[victim] == min(counts.values())


def test_lrfu_keeps_the_history_of_evicted_experts() -> None:
    """A working set larger than the cache, cycled: LRU never hits; LRFU keeps the experts that
    come back every step (their frequency survives eviction) and hits on them."""
    hot, cold = [0, 1], list(range(2, 40))
    trace = [hot + [cold[(4 * t + j) % len(cold)] for j in range(4)] for t in range(200)]
    hits = {}
    for policy in (LRUPolicy(), LRFUPolicy(8.0)):
        table = SlotTable(4, policy)
        n = 0
        for step in trace:
            policy.advance()
            for key in step:  # one key per lookup, like layers sharing a pool
                n += len(table.acquire([key]).hits)
                table.release([key])
        hits[policy.name] = n
    assert hits["lru"] == 0
    assert hits["lrfu"] >= 2 * 190


def test_lrfu_heap_stays_bounded() -> None:
    p = LRFUPolicy()
    for step in range(5000):
        p.reference([step % 7])
        p.advance()
    assert len(p) == 7 and len(p.heap) <= 4 * 7 + 64 + 1


def test_registry_and_bad_arguments() -> None:
    assert DEFAULT_POLICY in POLICIES
    assert make_policy("lru").name == "lru"
    with pytest.raises(ValueError, match="unknown expert-cache policy 'arc'.*lrfu"):
        make_policy("arc")
    with pytest.raises(ValueError, match="half_life"):
        LRFUPolicy(half_life=0)
    with pytest.raises(ValueError, match="admit_margin must be >= 0"):
        LRFUPolicy(admit_margin=-0.5)
    assert math.isclose(LRFUPolicy(4.0).half_life, 4.0)


def test_prefetched_keys_queue_behind_demoted_ones_under_lrfu() -> None:
    """A prefill stream's demoted keys go before keys prefetched for a later layer."""
    p = make_policy("lrfu")
    p.reference([1, 2])
    p.insert_prefetched(5)  # prefetched for layer L+1
    p.insert_unreferenced(7)  # demoted after layer L-1
    p.insert_prefetched(6)  # prefetched for layer L+2
    assert _drain(p) == [7, 5, 6, 1, 2]


def test_lru_treats_prefetched_as_unreferenced() -> None:
    p = make_policy("lru")
    p.reference([1])
    p.insert_prefetched(5)
    assert _drain(p) == [5, 1]


def test_admission_puts_a_cold_miss_on_probation() -> None:
    """A miss colder than the key it evicts is first in line after its use, so the next miss takes
    its slot and the hot keys stay."""
    p = LRFUPolicy(half_life=8.0, admit_margin=0.1)
    table = SlotTable(3, p)
    for _ in range(5):  # 1 and 2 are hot; 3 was used once
        p.advance()
        table.acquire([1, 2])
        table.release([1, 2])
    p.advance()
    table.acquire([3])
    table.release([3])
    for miss, victim in ((4, 3), (5, 4), (6, 5)):
        p.advance()
        look = table.acquire([miss])
        table.release([miss])
        assert look.evicted == [victim] and p.prio[miss] == -2e300 and p.victim(NONE_PINNED) == miss
    assert sorted(table.slot_of) == [1, 2, 6]


def test_admission_keeps_a_miss_with_more_history_than_its_victim() -> None:
    p = LRFUPolicy(half_life=8.0, admit_margin=0.1)
    for _ in range(4):  # 8 was used often, then evicted: its history stays
        p.reference([8])
        p.advance()
    p.remove(8)
    p.reference([3])
    p.filled(8, victim=3)
    p.filled(10, victim=8)  # never seen, against a key with history
    p.reference([8, 10])
    assert 8 not in p.probation and p.prio[8] > 0
    assert p.prio[10] == -2e300 and p.victim(NONE_PINNED) == 10
    plain = LRFUPolicy(half_life=8.0, admit_margin=None)
    plain.reference([3])
    plain.filled(10, victim=3)
    plain.reference([10])
    assert 10 not in plain.probation and plain.prio[10] >= 0


def _cyclic_hit_rate(policy: ReplacementPolicy, seed: int = 0) -> float:
    """A batched decode's routing: every step, each of 8 layers looks up the union of 16 tokens'
    uniformly random top-2 of 16 experts (most of the layer), with 48 slots for 128 experts."""
    rng = random.Random(seed)
    table = SlotTable(48, policy)
    hits = total = 0
    for step in range(200):
        policy.advance()
        for layer in range(8):
            keys = sorted({layer * 16 + e for _ in range(16) for e in rng.sample(range(16), 2)})
            look = table.acquire(keys)
            table.release(keys)
            if step >= 20:
                hits, total = hits + len(look.hits), total + len(keys)
    return hits / total


def test_admission_keeps_a_core_cached_under_cyclic_batched_routing() -> None:
    """LRFU without admission keeps replacing experts about to be used with ones about to be
    evicted; with it, about the slot share (48 / 128) hits."""
    plain = _cyclic_hit_rate(LRFUPolicy(16.0, admit_margin=None))
    admitted = _cyclic_hit_rate(LRFUPolicy(16.0))
    assert admitted > plain + 0.05
    assert admitted > 0.65 * 48 / 128  # the misses' rotating slots come out of the core


def test_lrfu_admits_a_link_read_key_once_its_history_beats_the_victims() -> None:
    """Link reads (experts/link_table.py): a miss is used without a slot, `seen` keeps its history,
    and `admits` lets it take a slot only once that history beats the victim's by the margin; a
    selective admit skips the others (no copy), LRU admits every key."""
    policy = LRFUPolicy(16.0)
    table = SlotTable(2, policy)
    for _ in range(3):  # keys 0 and 1 cached and used every step
        policy.advance()
        table.acquire([0, 1])
        table.release([0, 1])
    policy.advance()
    assert not policy.admits(7, victim=0)  # never seen: 1 against 0's history
    assert table.admit([7], selective=True).filled == []  # skipped: no copy, nothing evicted
    for _ in range(4):
        policy.seen([7])
        policy.advance()
    assert 7 not in policy.prio  # the history alone: still not cached for the policy
    assert policy.admits(7, victim=policy.victim(lambda k: False))
    assert [k for k, _ in table.admit([7], selective=True).filled] == [7]
    assert LRUPolicy().admits(7, victim=0)


def test_selective_admit_judges_the_victim_even_when_every_slot_is_avoided() -> None:
    """Right after a link step every cached slot is read by the step in flight (avoid): the victim
    is then any unpinned key, and a never-seen key still has to beat it."""
    policy = LRFUPolicy(16.0)
    table = SlotTable(2, policy)
    for _ in range(3):
        policy.advance()
        table.acquire([0, 1])
        table.release([0, 1])
    policy.advance()
    assert table.admit([7], avoid=lambda slot: True, selective=True).filled == []
    assert [k for k, _ in table.admit([7], avoid=lambda slot: True).filled] == [7]  # a guess is copied anyway
