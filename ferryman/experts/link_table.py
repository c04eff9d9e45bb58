"""Link reads: decode steps that read uncached experts over the link, with no host step per layer.

A copy-path decode step stops at every MoE layer: the host reads the routing (one sync), pins the
layer's experts, copies the misses in and maps expert ids to slots. In a link-read step the whole
step is one CUDA graph (engine/segment_graphs.py): each MoE layer maps its expert ids through
`table` [L, E] on the device, to a slot (cached, its copy landed) or to -1 - e, and the decode
kernel reads expert e from the layer's pinned host bank itself (`fused_moe_decode(host=)`). The
step logs its routing [L, bs, K]; `settle` does the cache's bookkeeping of a finished step for all
layers at once, while the GPU computes the next step: the policy sees the hits, and the misses it
admits over their victims are copied into slots for later steps (the others are read over the link
again when used).

Invariants, for every slot s:
- the device table names s only while the cache keeps that expert in s and after its copy
  landed: `publish` writes the table from the cache's slot table, on the compute stream, right
  before the step, leaving out slots whose copy is in flight (those experts are read over the link);
- a copy never overwrites s while a step that may read it runs: `logged` marks every slot the
  published table names as used once the step is enqueued, so a copy into it waits for the step
  (transfer.StreamTransfer's free events);
- `publish` writes from one of two pinned mirrors in turn, and `logged` into one of two host logs:
  the host refills either only two steps later, when the step between has been sampled (synced).
"""

from __future__ import annotations

from collections import deque

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
        # two host copies of the log in turn: a step's is read (settle) while the next one's may land
        self.log_hosts = [torch.zeros(n, max_bs, top_k, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.log_turn = 0
        self.pending_logs: deque[tuple[torch.Tensor, int, torch.cuda.Event | None]] = deque()  # (log, rows, done)
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
        host = self.log_hosts[self.log_turn]
        self.log_turn ^= 1
        host.copy_(self.log, non_blocking=True)  # whole: a contiguous copy stays async
        done = None
        if self.log.is_cuda:
            done = torch.cuda.Event()
            done.record()
        self.pending_logs.append((host, rows, done))

    def settle(self, keep: int = 0) -> None:
        """The bookkeeping of the logged steps but the newest `keep` (waits for them): counters,
        the policy's references, and copies of their misses (victims after the steps' reads).
        keep=1 right after a step is enqueued: the previous step's runs while the GPU computes."""
        while len(self.pending_logs) > keep:
            host, rows, done = self.pending_logs.popleft()
            if done is not None:
                done.synchronize()
            self._account(host[:, :rows].numpy())  # [L, B, K]

    def _account(self, ids: np.ndarray) -> None:
        # ids: [L, B, K]; per layer two bincounts, not a pass of array ops per layer (48 of them in
        # qwen3-30b-a3b, on the host between steps)
        cache, e, n = self.cache, self.cache.num_experts, len(self.layers)
        c, policy = cache.counters, cache.table.policy
        keys = np.unique(ids + (np.arange(n) * e)[:, None, None])  # every (layer, expert) used
        slot_of = cache.table.slot_of
        cached = np.fromiter((k in slot_of for k in keys.tolist()), dtype=bool, count=len(keys))
        rows = keys // e
        used = np.bincount(rows, minlength=n).tolist()
        hit = np.bincount(rows[cached], minlength=n).tolist()
        for m in np.flatnonzero(used).tolist():
            c.add(c.hits, self.layers[m], hit[m])
            c.add(c.misses, self.layers[m], used[m] - hit[m])
        policy.reference(keys[cached].tolist())
        missed = keys[~cached]  # ascending, so grouped by layer
        bounds = np.searchsorted(missed, np.arange(n + 1) * e).tolist()
        for m in range(n):
            if bounds[m] == bounds[m + 1]:
                continue
            layer = self.layers[m]
            mine = missed[bounds[m] : bounds[m + 1]] - m * e  # the layer's missed experts, ascending
            misses = mine.tolist()
            # [B, K] against a few misses: (token, k) pairs that read an expert over the link
            reads = int((ids[m][..., None] == mine).any(-1).sum())
            c.link_reads += reads
            c.link_read_bytes += reads * self.expert_bytes[layer]
            # used, not guessed: copied only where the policy admits them over a victim (a copy costs
            # the link what one more read of the expert does); the others keep their history only
            admitted = [m * e + x for x in cache.prefetch(layer, misses, selective=True)]
            cache.prefetched.difference_update(admitted)
            policy.reference(admitted)
            taken = set(admitted)
            policy.seen([m * e + x for x in misses if m * e + x not in taken])
