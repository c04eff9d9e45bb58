"""The expert cache's bookkeeping: which key sits in which slot, pins, and eviction by the policy.

A key is a flat expert id over all MoE layers (experts/gpu_cache.py). "In use" means pinned:
`acquire` pins the experts of the layer step being computed, `release` unpins them once the
kernels reading them are issued. A pinned key is never chosen as a victim. No tensors here.

Active slots: with a region shared with the KV cache (kvcache/shared_region.py) only some slot
ids are the cache's at a time. `add_slot` lends one more, `take_slot` gives one back: a free one
if any, else the policy's coldest unpinned key's, which is dropped (refetched on its next use).
Invariant: only active slots are free or hold keys; available() counts active slots not pinned.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ferryman.experts.policies import ReplacementPolicy


@dataclass
class Lookup:
    """What one lookup did. Keys in the order asked."""

    slots: list[int]  # slot of each key asked (acquire) or admitted (admit)
    hits: list[int] = field(default_factory=list)  # keys already cached
    filled: list[tuple[int, int]] = field(default_factory=list)  # (key, slot) to copy in
    evicted: list[int] = field(default_factory=list)  # keys that lost their slot, in order


class SlotTable:
    """Which key sits in which slot; pins; eviction by the policy. No tensors."""

    def __init__(self, num_slots: int, policy: ReplacementPolicy, active: Iterable[int] | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"the expert cache needs at least 1 slot, got {num_slots}")
        self.num_slots, self.policy = num_slots, policy
        self.slot_of: dict[int, int] = {}
        self.key_of: list[int | None] = [None] * num_slots
        self.pins = [0] * num_slots
        self.num_pinned = 0  # slots with pins > 0
        ids = sorted(range(num_slots) if active is None else set(active))
        self.active = [False] * num_slots  # slot ids the cache holds now
        for i in ids:
            self.active[i] = True
        self.num_active = len(ids)
        self.free = ids  # heap (sorted): the lowest free slot is used first

    def available(self) -> int:
        """Active slots not pinned: how many distinct keys one acquire may ask for."""
        return self.num_active - self.num_pinned

    def add_slot(self, slot: int) -> None:
        """Slot id `slot` joins the cache, empty."""
        if self.active[slot]:
            raise ValueError(f"slot {slot} is already the expert cache's")
        self.active[slot] = True
        self.num_active += 1
        heapq.heappush(self.free, slot)

    def take_slot(self, keep: Callable[[int], bool] = lambda s: False) -> tuple[int, int | None] | None:
        """Give one active slot back -> (slot, the key dropped from it or None): the highest free
        slot, else the slot of the policy's coldest key not pinned; never a slot keep(slot) protects.
        None when every candidate is pinned or kept."""
        free = [s for s in self.free if not keep(s)]
        if free:
            slot, key = max(free), None
            self.free.remove(slot)
            heapq.heapify(self.free)
        else:
            key = self.policy.victim(lambda k: self.is_pinned(k) or keep(self.slot_of[k]))
            if key is None:
                return None
            slot = self.slot_of.pop(key)
            self.policy.remove(key)
            self.key_of[slot] = None
        self.active[slot] = False
        self.num_active -= 1
        return slot, key

    def is_pinned(self, key: int) -> bool:
        slot = self.slot_of.get(key)
        return slot is not None and self.pins[slot] > 0

    def acquire(self, keys: list[int]) -> Lookup:
        """Cache and pin every key (distinct); victims are the policy's, never pinned keys."""
        if len(set(keys)) != len(keys):
            raise ValueError(f"acquire: keys must be distinct, got {keys}")
        need = sum(1 for k in keys if not self.is_pinned(k))
        if need > self.available():
            raise ValueError(f"acquire: {need} experts to pin but only {self.available()} of "
                             f"{self.num_slots} slots are not in use")
        look = Lookup(slots=[])
        hits = [k for k in keys if k in self.slot_of]
        for k in hits:  # pin the hits first: the misses' victims must not be among them
            self._pin(self.slot_of[k])
        for k in keys:
            if k not in self.slot_of:
                self._fill(k, look)
                self._pin(self.slot_of[k])
        look.hits = hits
        look.slots = [self.slot_of[k] for k in keys]
        self.policy.reference(keys)
        return look

    def admit(self, keys: list[int], avoid: Callable[[int], bool] | None = None, selective: bool = False) -> Lookup:
        """Prefetch: cache the keys not cached yet, unreferenced and unpinned, while a slot is
        free or evictable; a key admitted here is not evicted by a later key of the same call.
        avoid(slot): victims in such slots are taken only when no other is left (a copy into a slot
        whose reading kernel is still pending would hold the whole batch of copies back).
        selective: a key the policy does not admit over its victim is skipped (policy.admits)."""
        unavailable = self.is_pinned if avoid is None else \
            (lambda k: self.is_pinned(k) or avoid(self.slot_of[k]))  # noqa: E731
        look = Lookup(slots=[])
        taken: list[int] = []
        for k in keys:
            if k in self.slot_of:
                continue
            if self.available() == 0:
                break
            victim = None if self.free else self.policy.victim(unavailable)
            if selective:  # judged against the victim _fill would take (every slot avoided: any unpinned)
                if victim is None and not self.free:
                    victim = self.policy.victim(self.is_pinned)
                if not self.policy.admits(k, victim):
                    continue
            self._fill(k, look, victim)
            self.policy.insert_prefetched(k)
            self._pin(self.slot_of[k])
            taken.append(k)
        look.slots = [self.slot_of[k] for k in taken]
        self.release(taken)
        return look

    def release(self, keys: list[int]) -> None:
        for k in keys:
            slot = self.slot_of[k]
            if self.pins[slot] == 0:
                raise ValueError(f"release: expert key {k} is not pinned")
            self.pins[slot] -= 1
            self.num_pinned -= int(self.pins[slot] == 0)

    def _pin(self, slot: int) -> None:
        self.num_pinned += int(self.pins[slot] == 0)
        self.pins[slot] += 1

    def _fill(self, key: int, look: Lookup, victim: int | None = None) -> None:
        if self.free:
            slot = heapq.heappop(self.free)
        else:
            victim = self.policy.victim(self.is_pinned) if victim is None else victim
            if victim is None:  # acquire/admit checked available() first
                raise RuntimeError("expert cache: every slot is pinned")
            self.policy.filled(key, victim)
            slot = self.slot_of.pop(victim)
            self.policy.remove(victim)
            look.evicted.append(victim)
        self.slot_of[key], self.key_of[slot] = slot, key
        look.filled.append((key, slot))
