"""The device expert cache: fixed slots, a table (layer, expert) -> slot, a replacement policy.

    SlotTable    bookkeeping only (keys, slots, pins, policy): what a lookup hits, fills, evicts
                 (experts/slot_table.py)
    SlotPool     the slot banks on the device, `banks[name]: [S, ...]`, and how to copy into them
    ExpertCache  both, plus the host store, the transfer engine and the statistics

A key is a flat expert id over all MoE layers, `moe_index(layer) * E + expert`: one pool of slots
serves every layer (one global policy, like a single LRU over all experts), and a slot holds one
expert with all its banks, so one kernel reads resident, cached and streamed experts alike.

"In use" means pinned: `acquire` pins the experts of the layer step being computed, `release`
unpins them once the kernels reading them are issued. A pinned key is never chosen as a victim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ferryman.experts.host_store import HostExpertStore
from ferryman.experts.policies import ReplacementPolicy
from ferryman.experts.slot_table import Lookup, SlotTable
from ferryman.experts.transfer import Copy, Transfer, make_transfer
from ferryman.quant.layout import ExpertLayout


class SlotPool:
    """Slot banks on the device: one `[S, row_bytes]` buffer laid out like the host store (expert
    major), so a run of consecutive experts into consecutive slots is one copy; the bank views are
    strided along the slot dim (every kernel reads them)."""

    def __init__(self, layout: ExpertLayout, num_slots: int, device: torch.device,
                 rows: torch.Tensor | None = None) -> None:
        self.layout, self.num_slots, self.device = layout, num_slots, device
        # zeroed: a captured MoE graph may read a slot no copy has filled yet (padding rows);
        # rows: the slot rows of a region shared with the KV cache (kvcache/shared_region.py)
        self.flat = torch.zeros((num_slots, layout.row_bytes), dtype=torch.uint8, device=device) \
            if rows is None else rows
        self.contiguous = self.flat.is_contiguous()  # a shared region's rows are a page apart
        self.banks = layout.views(self.flat)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.layout.row_bytes

    def views_of(self, layout: ExpertLayout) -> dict[str, torch.Tensor]:
        """Bank views of a narrower layer's experts: each slot's first `layout.row_bytes` bytes."""
        return self.banks if layout == self.layout else layout.views(self.flat[:, : layout.row_bytes])

    def copies(self, store: HostExpertStore, layer: int, pairs: list[tuple[int, int]]) -> list[Copy]:
        """Copies filling slot s with expert e of `layer` for each (e, s). A layer narrower than the
        slots (mixed formats) copies only its own row bytes, one expert per copy (each contiguous)."""
        rows = store.flat[layer]
        width = rows.shape[1]
        if width != self.layout.row_bytes:
            return [Copy(rows[e], self.flat[s, :width]) for e, s in sorted(pairs)]
        # a shared region's rows are a page apart: one copy per expert
        runs = coalesce(pairs) if self.contiguous else [(e, s, 1) for e, s in sorted(pairs)]
        return [Copy(rows[e0 : e0 + n], self.flat[s0 : s0 + n]) for e0, s0, n in runs]


def coalesce(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) index pairs -> runs (src0, dst0, n) where both advance by one, in src order."""
    runs: list[tuple[int, int, int]] = []
    for e, s in sorted(pairs):
        if runs and runs[-1][0] + runs[-1][2] == e and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((e, s, 1))
    return runs


@dataclass
class CacheCounters:
    """Per MoE layer: demand hits and misses; prefetched experts, and those used before eviction."""

    hits: dict[int, int] = field(default_factory=dict)
    misses: dict[int, int] = field(default_factory=dict)
    prefetch_fetched: dict[int, int] = field(default_factory=dict)
    prefetch_hits: dict[int, int] = field(default_factory=dict)
    evictions: int = 0
    link_reads: int = 0  # link-read decode steps: (token, expert) pairs the kernel read from host memory
    link_read_bytes: int = 0  # and their expert bytes (each pair reads its expert once)

    @staticmethod
    def add(table: dict[int, int], layer: int, n: int) -> None:
        table[layer] = table.get(layer, 0) + n


class ExpertCache:
    """Slots on `device` caching the experts of a `HostExpertStore`."""

    def __init__(self, store: HostExpertStore, num_slots: int, device: torch.device,
                 policy: ReplacementPolicy, transfer: Transfer | None = None,
                 rows: torch.Tensor | None = None, active: Iterable[int] | None = None) -> None:
        if store.layout is None:
            raise ValueError("the expert cache needs a model with routed experts")
        self.store, self.device = store, torch.device(device)
        self.num_experts = store.cfg.num_experts
        self.moe_index = {layer: i for i, layer in enumerate(store.cfg.moe_layers)}
        # rows / active: a region shared with the KV cache, `active` of its pages slots at first
        self.table = SlotTable(num_slots, policy, active)
        self.pool = SlotPool(store.layout, num_slots, self.device, rows)
        # per layer: its format and bank views of the slots (the same for every layer but in mixed-format models)
        self.layer_banks = {layer: self.pool.views_of(layout) for layer, layout in store.layouts.items()}
        self.transfer = transfer or make_transfer(self.device, num_slots)
        self.counters = CacheCounters()
        self.prefetched: set[int] = set()  # keys admitted by prefetch and not used since
        self.last_fetched: list[int] = []  # keys the last acquire copied in, or found prefetched

    @property
    def shared_rows(self) -> torch.Tensor | None:
        """The slot rows when they lie in a region shared with the KV cache, else None."""
        return None if self.pool.contiguous else self.pool.flat

    def active_slots(self) -> list[int]:
        return [s for s in range(self.table.num_slots) if self.table.active[s]]

    @property
    def banks(self) -> dict[str, torch.Tensor]:
        return self.pool.banks

    def banks_of(self, layer: int) -> dict[str, torch.Tensor]:
        """The slot banks as `layer`'s format reads them."""
        return self.layer_banks[layer]

    def format_of(self, layer: int) -> str:
        return self.store.formats[layer].name

    def key(self, layer: int, expert: int) -> int:
        return self.moe_index[layer] * self.num_experts + expert

    def begin_step(self) -> None:
        self.table.policy.advance()

    def available(self) -> int:
        """Slots a layer step may pin: those not pinned."""
        return self.table.available()

    def acquire(self, layer: int, experts: list[int]) -> list[int]:
        """Make `experts` of `layer` resident and pinned; kernels issued next may read their slots."""
        keys = [self.key(layer, e) for e in experts]
        look = self.table.acquire(keys)
        c = self.counters
        c.add(c.hits, layer, len(look.hits))
        c.add(c.misses, layer, len(look.filled))
        c.add(c.prefetch_hits, layer, sum(1 for k in look.hits if k in self.prefetched))
        self.last_fetched = [k for k, _ in look.filled] + [k for k in look.hits if k in self.prefetched]
        self.prefetched.difference_update(look.hits)
        self._fetch(layer, look, demand=True)
        self.transfer.wait(look.slots)
        return look.slots

    def release(self, layer: int, experts: list[int], slots: list[int]) -> None:
        """The kernels reading `slots` are issued: unpin (copies into them will wait for those)."""
        self.transfer.mark_used(slots)
        self.table.release([self.key(layer, e) for e in experts])

    def stream_quota(self) -> int:
        """Experts per MoE layer a prefill stream keeps cached from one chunk to the next: the slots
        left once two layers' worth (the layer computing, the next one streaming in) are set aside,
        shared evenly among the layers."""
        return max(0, (self.table.num_active - 2 * self.num_experts) // len(self.moe_index))

    def demote_fetched(self, layer: int) -> int:
        """Scan resistance for a prefill stream: the experts the last acquire brought in (copied, or
        prefetched for it) become the next victims, beyond the layer's `stream_quota` of experts
        that stay, so a chunk that touches every expert cycles them through a window of slots
        instead of flushing the experts that stay cached from one chunk to the next.

        Invariant: every layer keeps about the same number cached, so every layer streams the same
        share and each layer's kernels overlap a copy. Call after `release`, with the layer of the
        last acquire. Returns how many were demoted."""
        fetched = set(self.last_fetched)
        base = self.moe_index[layer] * self.num_experts
        kept = sum(1 for k in range(base, base + self.num_experts) if k in self.table.slot_of and k not in fetched)
        room = max(0, self.stream_quota() - kept)  # fetched experts that may stay
        movable = [k for k in self.last_fetched if k in self.table.slot_of and not self.table.is_pinned(k)]
        demoted = movable[room:]
        for k in demoted:
            self.table.policy.insert_unreferenced(k)
        self.last_fetched = []
        return len(demoted)

    def prefetch(self, layer: int, experts: list[int], streaming: bool = False, selective: bool = False) -> list[int]:
        """Start copying the uncached ones of `experts` into slots not in use (as many as there
        are such slots); returns the experts whose copies started. streaming: a prefill chunk's
        guess, whose victims are chosen by the policy alone. selective: only those the policy
        admits over their victims (SlotTable.admit)."""
        keys = [self.key(layer, e) for e in experts]
        # decode: victims whose reading kernel may still be pending are taken last: one such slot
        # would make the whole batch of copies wait for that kernel. Not for a prefill stream: its
        # victims would then be experts the next chunk needs again (docs/benchmarks.md)
        look = self.table.admit(keys, avoid=None if streaming else self.transfer.busy, selective=selective)
        self.counters.add(self.counters.prefetch_fetched, layer, len(look.filled))
        self.prefetched.update(k for k, _ in look.filled)
        self._fetch(layer, look, demand=False)
        base = self.moe_index[layer] * self.num_experts
        return [k - base for k, _ in look.filled]

    def lend_slot(self, slot: int) -> None:
        """Slot id `slot` (a page the KV cache gave up) joins the cache; copies into it wait for the
        KV kernels issued so far."""
        self.transfer.mark_used([slot])
        self.table.add_slot(slot)

    def reclaim_slot(self, keep: Callable[[int], bool] = lambda s: False) -> int | None:
        """Give back a free slot, else the coldest unpinned expert's (dropped: refetched before its
        next use); kernels issued from now on (the KV cache's) are ordered after copies into it.
        None when none can go."""
        taken = self.table.take_slot(keep)
        if taken is None:
            return None
        slot, key = taken
        if key is not None:
            self.prefetched.discard(key)
            self.counters.evictions += 1
        self.transfer.wait([slot])
        return slot

    def contains(self, layer: int, expert: int) -> bool:
        return self.key(layer, expert) in self.table.slot_of

    def _fetch(self, layer: int, look: Lookup, demand: bool) -> None:
        self.counters.evictions += len(look.evicted)
        self.prefetched.difference_update(look.evicted)
        if not look.filled:
            return
        base = self.moe_index[layer] * self.num_experts
        pairs = [(k - base, s) for k, s in look.filled]
        self.transfer.fetch(self.pool.copies(self.store, layer, pairs), [s for _, s in pairs], demand)

    def stats(self, block: bool = True) -> dict:
        """Counters; block=False leaves copies still in flight out of the link times instead of
        waiting for them (a server's periodic refresh must not sync the copy stream mid-pipeline)."""
        c = self.counters
        hits, misses = sum(c.hits.values()), sum(c.misses.values())
        h2d_s, stall_s = self.transfer.seconds(block)
        per_layer = {layer: c.hits.get(layer, 0) / max(1, c.hits.get(layer, 0) + c.misses.get(layer, 0))
                     for layer in self.moe_index if layer in c.hits}
        return {
            "slots": self.table.num_active,
            "slots_filled": len(self.table.slot_of),
            "slot_bytes": self.pool.layout.row_bytes,
            "cache_fraction": self.table.num_active / (len(self.moe_index) * self.num_experts),
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / max(1, hits + misses),
            "prefetch_fetched": sum(c.prefetch_fetched.values()),
            "prefetch_hits": sum(c.prefetch_hits.values()),
            "evictions": c.evictions,
            "link_reads": c.link_reads,
            "link_read_bytes": c.link_read_bytes,
            "bytes_h2d": self.transfer.bytes,
            "copies_h2d": self.transfer.copies,
            "h2d_seconds": h2d_s,
            "stall_seconds": stall_s,
            "host_pinned": self.store.pinned,
            "per_layer_hit_rate": per_layer,
        }
