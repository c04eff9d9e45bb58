"""Replacement policies of the expert cache: which cached expert to evict for a new one.

A policy ranks *keys* (flat expert ids, `moe_layer_index * E + expert`); the slot table
(`experts/gpu_cache.py`) tells it what is referenced, inserted and removed, and asks it for
victims, passing the keys it must skip (pinned: in use by the current layer step).

- `lru`: least recently used; a step's keys become most recent in the order given.
- `lrfu`: least recently/frequently used (Lee et al., 2001). Each key keeps a combined
  recency-frequency value CRF = sum over its references of 2^(-(now - t_ref) / half_life),
  time counted in engine steps; the victim has the smallest CRF. half_life -> 0 is LRU,
  half_life -> inf is LFU. Ranking by CRF at a common time equals ranking by
  p = log2(CRF(t_last)) + t_last / half_life, which does not change until the key is referenced
  again, so a heap with lazy deletion finds victims in O(log n). The history of evicted keys is
  kept (the key space, layers x experts, is small).

Admission (lrfu, `admit_margin`): a key that takes a slot from a victim whose decayed CRF is
higher (by the margin) than its own goes on *probation*: after its first use it sits just above
demoted keys at the eviction end, so the next miss takes its slot instead of a wanted expert. When
a batched decode step cycles through more experts than the slots hold, plain LRFU (like LRU) keeps
replacing experts about to be used again; with admission a stable core stays cached and the misses
rotate through a few slots (benchmarks/bench_cache_policies.py --synthetic).

Prefetched keys (brought in on a guess, not yet referenced) enter at the eviction end: a wrong
guess is the first thing to go, a right one is referenced when its layer runs. Under lrfu they
queue behind keys demoted by a prefill stream (`insert_unreferenced`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable

Pinned = Callable[[int], bool]

# lrfu priorities below any referenced key's log2(crf) + now / half_life (>= 0), in eviction order:
# demoted (-inf), then a used key on probation, then an unreferenced prefetched key
_PROBATION = -2e300
_PREFETCHED = -1e300
# lrfu admission margin (None: off): a miss is kept only if its CRF beats its victim's by this factor
ADMIT_MARGIN: float | None = 0.1


class ReplacementPolicy(ABC):
    """Order of eviction over the keys currently cached."""

    name: str

    def advance(self) -> None:
        """One engine step has passed (policies that count time use it)."""

    @abstractmethod
    def reference(self, keys: Iterable[int]) -> None:
        """`keys` were used by the current step (cached before, or just inserted), in this order."""

    @abstractmethod
    def insert_unreferenced(self, key: int) -> None:
        """`key` was cached without being used (prefetch), or is a prefill stream's use-once
        expert (already cached): first in line for eviction."""

    def insert_prefetched(self, key: int) -> None:
        """`key` was copied in on a guess: evicted early, but after demoted keys where the policy
        can tell them apart (lrfu; lru puts both first in line)."""
        self.insert_unreferenced(key)

    def filled(self, key: int, victim: int | None) -> None:
        """`key` took a slot, evicting `victim` (None: a free slot), before its first reference;
        policies with admission control decide here whether it stays on probation."""

    def admits(self, key: int, victim: int | None) -> bool:
        """Whether `key`, about to be used, is worth a copy that evicts `victim` (None: a free
        slot); asked where a miss need not be cached to be used (link reads, experts/link_table.py)."""
        return True

    def seen(self, keys: Iterable[int]) -> None:
        """`keys` were used without being cached (read over the link): policies that keep a
        history count the use, so a key used often enough is admitted later."""

    @abstractmethod
    def remove(self, key: int) -> None:
        """`key` left the cache."""

    @abstractmethod
    def victim(self, pinned: Pinned) -> int | None:
        """The key to evict next among those not pinned (None if every cached key is pinned)."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(ReplacementPolicy):
    name = "lru"

    def __init__(self) -> None:
        self.order: OrderedDict[int, None] = OrderedDict()  # first = least recently used

    def reference(self, keys: Iterable[int]) -> None:
        for key in keys:
            self.order[key] = None
            self.order.move_to_end(key)

    def insert_unreferenced(self, key: int) -> None:
        self.order[key] = None
        self.order.move_to_end(key, last=False)

    def remove(self, key: int) -> None:
        self.order.pop(key, None)

    def victim(self, pinned: Pinned) -> int | None:
        # pinned keys are the current step's: few, and near the recent end
        return next((k for k in self.order if not pinned(k)), None)

    def __len__(self) -> int:
        return len(self.order)


class LRFUPolicy(ReplacementPolicy):
    name = "lrfu"

    def __init__(self, half_life: float = 16.0, admit_margin: float | None = ADMIT_MARGIN) -> None:
        if not half_life > 0:
            raise ValueError(f"lrfu half_life must be > 0 steps, got {half_life}")
        if admit_margin is not None and admit_margin < 0:
            raise ValueError(f"lrfu admit_margin must be >= 0 or None (no admission control), got {admit_margin}")
        self.half_life, self.admit_margin = half_life, admit_margin
        self.probation: set[int] = set()  # filled keys not yet referenced that lost the admission test
        self.now = 0
        self.last: dict[int, int] = {}  # key -> step of its last reference (cached or not)
        self.crf: dict[int, float] = {}  # key -> CRF at its last reference (cached or not)
        self.prio: dict[int, float] = {}  # cached key -> log2(crf) + last / half_life (its heap entry)
        self.heap: list[tuple[float, int, int]] = []  # (prio, tie, key); stale entries skipped
        self.tie = itertools.count()

    def advance(self) -> None:
        self.now += 1

    def _push(self, key: int, prio: float) -> None:
        self.prio[key] = prio
        # older entries of the same key become stale: their prio no longer matches self.prio
        heapq.heappush(self.heap, (prio, next(self.tie), key))
        if len(self.heap) > 4 * len(self.prio) + 64:
            self._compact()

    def _compact(self) -> None:
        self.heap = [e for e in self.heap if self.prio.get(e[2]) == e[0]]
        heapq.heapify(self.heap)

    def decayed(self, key: int) -> float:
        """`key`'s CRF now (0 if never referenced)."""
        return self.crf.get(key, 0.0) * 2.0 ** (-(self.now - self.last.get(key, self.now)) / self.half_life)

    def filled(self, key: int, victim: int | None) -> None:
        if not self.admits(key, victim):
            self.probation.add(key)

    def admits(self, key: int, victim: int | None) -> bool:
        # both sides count one reference more (+1, the key's is about to happen): a key is kept
        # only if it beats its victim by the margin, so a tie (two never-seen keys) is not
        return victim is None or self.admit_margin is None or \
            self.decayed(key) + 1.0 >= (1.0 + self.admit_margin) * (self.decayed(victim) + 1.0)

    def seen(self, keys: Iterable[int]) -> None:
        for key in keys:  # the history only: an uncached key gets no heap entry
            self.crf[key], self.last[key] = 1.0 + self.decayed(key), self.now

    def reference(self, keys: Iterable[int]) -> None:
        for key in keys:
            crf = 1.0 + self.decayed(key)
            self.crf[key], self.last[key] = crf, self.now
            if key in self.probation:  # its first use after a fill that failed admission
                self.probation.discard(key)
                self._push(key, _PROBATION)
            else:
                self._push(key, math.log2(crf) + self.now / self.half_life)

    def insert_unreferenced(self, key: int) -> None:
        self._push(key, -math.inf)  # its history (crf, last) is kept for when it is referenced

    def insert_prefetched(self, key: int) -> None:
        self._push(key, _PREFETCHED)  # after every demoted key (-inf), before every referenced one

    def remove(self, key: int) -> None:
        # Only the heap membership goes: the history stays, so an expert evicted by a burst of
        # one-time keys comes back with its frequency (without it, a pool smaller than a step's
        # working set never sees a second reference and LRFU degrades to LRU).
        self.prio.pop(key, None)
        self.probation.discard(key)

    def victim(self, pinned: Pinned) -> int | None:
        skipped: list[tuple[float, int, int]] = []
        found = None
        while self.heap:
            entry = heapq.heappop(self.heap)
            if self.prio.get(entry[2]) != entry[0]:
                continue  # stale
            skipped.append(entry)
            if not pinned(entry[2]):
                found = entry[2]
                break
        for entry in skipped:  # the victim stays listed until remove() is called
            heapq.heappush(self.heap, entry)
        return found

    def __len__(self) -> int:
        return len(self.prio)


POLICIES: dict[str, Callable[[], ReplacementPolicy]] = {"lru": LRUPolicy, "lrfu": LRFUPolicy}
DEFAULT_POLICY = "lrfu"


def make_policy(name: str = DEFAULT_POLICY, **kwargs: float) -> ReplacementPolicy:
    """A fresh policy by name; ValueError listing the known names otherwise."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown expert-cache policy {name!r}; known: {sorted(POLICIES)}")
    return factory(**kwargs)
