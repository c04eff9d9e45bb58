"""The moving boundary between KV pages and expert slots in the shared region.

The region's pages (kvcache/shared_region.py) are owned either by the block pool (KV) or by the
expert cache (slots). Between steps the engine asks:
  - `ensure_kv(n)` (the scheduler, when a sequence needs n more free blocks): expert slots go back
    to the KV cache, free slots first, then the coldest cached experts in the policy's order, never
    a pinned one nor page 0, down to `min_slots`;
  - `rebalance()` (after every step): idle KV pages (no block held) beyond `kv_reserve` free
    blocks become expert slots, up to `max_slots`. The KV floor (`min_kv_pages`, one sequence of
    max_model_len) is an admission guarantee, not a reservation: its idle pages serve as slots too
    (a lone short sequence leaves most of it idle), and `ensure_kv` brings them back on demand,
    which the bounds always allow (min_slots <= num_pages - min_kv_pages, `set_bounds`).

Invariant: every page has exactly one owner (`owner[p]`); an expert page's blocks are withdrawn
from the block pool, a KV page's slot id is not active in the slot table. A moved expert is dropped
from the slot table (refetched on its next use); no bytes are copied. Moves happen between steps,
never while a step's kernels are being issued: `ExpertCache.reclaim_slot` orders later kernels after
any copy into the slot, `lend_slot` orders later copies after the KV kernels issued so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ferryman.kvcache.block_pool import BlockPool

KV, EXPERT = "kv", "expert"
# page 0 stays an expert slot: padding rows of a captured MoE graph read slot 0
PINNED_PAGE = 0


class SlotLender(Protocol):
    """What the split needs of the expert cache (experts/gpu_cache.py's ExpertCache)."""

    def lend_slot(self, slot: int) -> None: ...

    def reclaim_slot(self, keep: Callable[[int], bool] = ...) -> int | None: ...

    def active_slots(self) -> list[int]: ...


@dataclass
class SplitBounds:
    """Live bounds of the split (`ferryman ctl`, `LLM.set_memory_bounds`)."""

    min_slots: int  # expert slots never given back below this
    max_slots: int  # expert slots never grown beyond this
    kv_reserve: int  # free KV blocks kept when idle pages become slots


@dataclass
class SplitCounters:
    to_kv: int = 0  # pages moved from the expert cache to the KV cache
    to_experts: int = 0  # pages moved from the KV cache to the expert cache


class MemorySplit:
    def __init__(self, pool: BlockPool, cache: Callable[[], SlotLender], num_pages: int,
                 bounds: SplitBounds, min_kv_pages: int) -> None:
        """cache: the current expert cache (a rebound backend brings a new one over the same region);
        min_kv_pages: the KV floor (one sequence of max_model_len) that `ensure_kv` can always
        restore: min_slots never reaches into it."""
        self.pool, self.cache, self.num_pages = pool, cache, num_pages
        self.bounds, self.min_kv_pages = bounds, min_kv_pages
        self.counters = SplitCounters()
        experts = set(cache().active_slots())
        self.owner = [EXPERT if p in experts else KV for p in range(num_pages)]
        if self.owner[PINNED_PAGE] != EXPERT:
            raise ValueError(f"page {PINNED_PAGE} of the shared region must start as an expert slot")
        for p in range(num_pages):
            if self.owner[p] == EXPERT:
                pool.withdraw_page(p)

    # ---- counts ------------------------------------------------------------------------------

    @property
    def expert_pages(self) -> int:
        return self.owner.count(EXPERT)

    @property
    def kv_pages(self) -> int:
        return self.num_pages - self.expert_pages

    @property
    def free_blocks(self) -> int:
        return len(self.pool.free_queue)

    # ---- moves -------------------------------------------------------------------------------

    def ensure_kv(self, blocks: int) -> bool:
        """Make at least `blocks` KV blocks free by taking expert slots back; False if the bounds or
        pinned slots stop it first (what was moved stays moved)."""
        cache = self.cache()
        while self.free_blocks < blocks and self.expert_pages > self.bounds.min_slots:
            slot = cache.reclaim_slot(keep=lambda s: s == PINNED_PAGE)
            if slot is None:
                return False
            self._to_kv(slot)
        return self.free_blocks >= blocks

    def rebalance(self) -> int:
        """Idle KV pages beyond the reserve become expert slots (the highest-numbered idle pages
        first); returns how many moved."""
        q, moved = self.pool.blocks_per_page, 0
        room = self.bounds.max_slots - self.expert_pages
        spare = self.free_blocks - self.bounds.kv_reserve
        if room <= 0 or spare < q:
            return 0
        cache = self.cache()
        idle = [p for p in range(self.num_pages - 1, -1, -1) if self.owner[p] == KV and self.pool.page_idle(p)]
        idle.sort(key=self.pool.cached_in_page)  # cached prompt prefixes go last (stable: high pages first)
        for p in idle:
            if moved >= room or spare < q:
                break
            self.pool.withdraw_page(p)
            self.owner[p] = EXPERT
            cache.lend_slot(p)
            self.counters.to_experts += 1
            moved, spare = moved + 1, spare - q
        return moved

    def shrink_to_bounds(self) -> int:
        """After new bounds: give back slots above max_slots (as far as pins allow); returns how many."""
        cache, moved = self.cache(), 0
        while self.expert_pages > self.bounds.max_slots:
            slot = cache.reclaim_slot(keep=lambda s: s == PINNED_PAGE)
            if slot is None:
                break
            self._to_kv(slot)
            moved += 1
        return moved

    def _to_kv(self, page: int) -> None:
        self.owner[page] = KV
        self.pool.restore_page(page)
        self.counters.to_kv += 1

    # ---- reporting ---------------------------------------------------------------------------

    def snapshot(self) -> dict:
        q = self.pool.blocks_per_page
        held = (self.pool.num_blocks - self.pool.num_withdrawn) - self.free_blocks
        return {
            "pages": self.num_pages,
            "kv_pages": self.kv_pages,
            "expert_pages": self.expert_pages,
            "blocks_per_page": q,
            "kv_blocks_used": held,
            "kv_blocks_free": self.free_blocks,
            "min_kv_pages": self.min_kv_pages,
            "min_expert_slots": self.bounds.min_slots,
            "max_expert_slots": self.bounds.max_slots,
            "kv_reserve_blocks": self.bounds.kv_reserve,
            "moves_to_kv": self.counters.to_kv,
            "moves_to_experts": self.counters.to_experts,
        }

    # ---- live bounds -------------------------------------------------------------------------

    def set_bounds(self, min_slots: int | None = None, max_slots: int | None = None,
                   kv_reserve: int | None = None) -> SplitBounds:
        """New bounds (None keeps one); ValueError naming the bound when out of range. Slots above a
        lower max go back to the KV cache now; the rest follows the load from the next step on."""
        b = self.bounds
        new = SplitBounds(b.min_slots if min_slots is None else min_slots,
                          b.max_slots if max_slots is None else max_slots,
                          b.kv_reserve if kv_reserve is None else kv_reserve)
        most = self.num_pages - self.min_kv_pages  # the KV floor (one max_model_len sequence) stays
        if not 1 <= new.min_slots <= most:
            raise ValueError(f"min_expert_slots must be in [1, {most}], got {new.min_slots}")
        if not new.min_slots <= new.max_slots:
            raise ValueError(f"max_expert_slots must be >= min_expert_slots ({new.min_slots}), got {new.max_slots}")
        if new.kv_reserve < 0:
            raise ValueError(f"kv_reserve must be >= 0, got {new.kv_reserve}")
        self.bounds = new
        self.shrink_to_bounds()
        return new
