"""Link reads: decode steps that read uncached experts over the link, with no host step per layer.

A copy-path decode step stops at every MoE layer: the host reads the routing (one sync), pins the
layer's experts, copies the misses in and maps expert ids to slots. In a link-read step the whole
step is one CUDA graph (engine/segment_graphs.py): each MoE layer maps its expert ids through
`table` [L, E] on the device, to a slot (cached, its copy landed) or to -1 - e, and the decode
kernel reads expert e from the layer's pinned host bank itself (`fused_moe_decode(host=)`). The
step logs its routing [L, bs, K]; once it is done, `settle` does the cache's bookkeeping for all
layers at once: the policy sees the hits, and the misses it admits over their victims are copied
into slots for later steps (the others are read over the link again when used).

Invariants, for every slot s:
- the device table names s only while the cache keeps that expert in s and after its copy
  landed: `publish` writes the table from the cache's slot table, on the compute stream, right
  before the step, leaving out slots whose copy is in flight (those experts are read over the link);
- a copy never overwrites s while a step that may read it runs: `logged` marks every slot the
  published table names as used once the step is enqueued, so a copy into it waits for the step
  (transfer.StreamTransfer's free events);
- `publish` writes from one of two pinned mirrors in turn: the host refills a mirror only after
  the copy from it two steps ago (`settle` syncs on the step in between).
"""

from __future__ import annotations

import numpy as np
import torch

from ferryman.experts.gpu_cache import ExpertCache
from ferryman.layers.moe_common import HostBank, host_tables


class LinkTable:
    """The device table, the routing log and the host banks of link-read decode steps."""

    def __init__(self, cache: ExpertCache, max_bs: int, top_k: int) -> None:
        self.cache = cache
        self.layers = list(cache.moe_index)  # MoE layer ids, row m of the table is layer layers[m]
        n, e, dev = len(self.layers), cache.num_experts, cache.device
        pin = dev.type == "cuda"
        self.unread = (-1 - torch.arange(e, dtype=torch.int32)).expand(n, e).contiguous()  # [L, E] all over the link
        self.table = self.unread.to(dev, copy=True)  # [L, E] slot, or -1 - e (a warm-up reads it before any publish)
        self.mirrors = [torch.empty(n, e, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.turn = 0
        self.log = torch.zeros(n, max_bs, top_k, dtype=torch.int32, device=dev)  # [L, max_bs, K] expert ids
        self.log_host = torch.zeros(n, max_bs, top_k, dtype=torch.int32, pin_memory=pin)
        self.rows = 0  # rows of the logged step not settled yet
        self.done: torch.cuda.Event | None = None
        self.named: list[int] = []  # slots the last published table names
        self.expert_bytes = {layer: cache.store.layouts[layer].row_bytes for layer in self.layers}
        self.banks = {layer: HostBank(cache.store.banks[layer], host_tables(cache.format_of(layer),
                                      cache.banks_of(layer), cache.store.banks[layer], dev))
                      for layer in self.layers}

    def row(self, layer: int) -> int:
        return self.cache.moe_index[layer]

    def publish(self) -> None:
        """The table for the next step, from the cache's slot table (compute stream)."""
        mirror = self.mirrors[self.turn]
        self.turn ^= 1
        mirror.copy_(self.unread)
        slot_of = self.cache.table.slot_of
        if slot_of:
            keys = np.fromiter(slot_of.keys(), dtype=np.int64, count=len(slot_of))
            slots = np.fromiter(slot_of.values(), dtype=np.int64, count=len(slot_of))
            pending = self.cache.transfer.pending()
            if pending:
                keep = ~np.isin(slots, np.fromiter(pending, dtype=np.int64, count=len(pending)))
                keys, slots = keys[keep], slots[keep]
            mirror.numpy().reshape(-1)[keys] = slots
            self.named = slots.tolist()
        else:
            self.named = []
        self.table.copy_(mirror, non_blocking=True)

    def logged(self, rows: int) -> None:
        """The step reading the published table is enqueued and logged its first `rows` rows."""
        self.cache.transfer.mark_used(self.named)
        self.log_host.copy_(self.log, non_blocking=True)  # whole: a contiguous copy stays async
        self.rows = rows
        if self.log.is_cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    def settle(self) -> None:
        """The logged step's bookkeeping (waits for it): counters, the policy's references, and
        copies of its misses into slots (victims by the policy, after the step's reads)."""
        if not self.rows:
            return
        if self.done is not None:
            self.done.synchronize()
        ids = self.log_host[:, : self.rows].numpy()  # [L, B, K]
        self.rows, self.done = 0, None
        cache, e = self.cache, self.cache.num_experts
        c = cache.counters
        for m, layer in enumerate(self.layers):
            used = np.unique(ids[m])
            keys = (m * e + used).tolist()
            hits = [k for k in keys if k in cache.table.slot_of]
            c.add(c.hits, layer, len(hits))
            c.add(c.misses, layer, len(keys) - len(hits))
            cache.table.policy.reference(hits)
            misses = [k - m * e for k in keys if k not in cache.table.slot_of]
            if misses:
                reads = int(np.isin(ids[m], misses).sum())
                c.link_reads += reads
                c.link_read_bytes += reads * self.expert_bytes[layer]
            if misses:  # used, not guessed: copied only where the policy admits them over a victim
                # (a copy costs the link what one more read of the expert does)
                admitted = [m * e + x for x in cache.prefetch(layer, misses, selective=True)]
                cache.prefetched.difference_update(admitted)
                cache.table.policy.reference(admitted)
                taken = set(admitted)
                cache.table.policy.seen([m * e + x for x in misses if m * e + x not in taken])
