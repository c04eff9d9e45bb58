"""Routing traces (measurement, not engine code): which experts each token chose, per MoE layer, and
what caches would make of it.

A trace is the workload of every expert-cache measurement: `RoutingTrace` records the top-k ids
that `SparseMoE` computes (attach it with `attach_trace(model, trace)`), and the functions below
replay a trace in token order.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class RoutingTrace:
    # ids[layer]: list of [T_i, K] int tensors (CPU), in the order the tokens were computed
    ids: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.ids.setdefault(layer, []).append(topk_ids.detach().to("cpu", torch.int64))

    def layer(self, layer: int) -> torch.Tensor:
        """[T, K] expert ids of one layer, all recorded tokens in order."""
        return torch.cat(self.ids[layer]) if layer in self.ids else torch.empty(0, 0, dtype=torch.int64)

    @property
    def layers(self) -> list[int]:
        return sorted(self.ids)


def attach_trace(model: torch.nn.Module, trace: RoutingTrace | None) -> None:
    """Make every MoE block of `model` record into `trace` (None detaches)."""
    for block in model.moe_blocks():
        block.trace = trace


def top_share(ids: torch.Tensor, num_experts: int, fraction: float = 0.1) -> float:
    """Share of all selections taken by the most-selected `fraction` of experts. ids: [T, K]."""
    counts = torch.bincount(ids.flatten(), minlength=num_experts).sort(descending=True).values
    n = max(1, round(fraction * num_experts))
    return counts[:n].sum().item() / max(1, counts.sum().item())


def reuse_within(ids: torch.Tensor, window: int) -> float:
    """How often an expert selected at token t is selected again at one of tokens t+1..t+window."""
    T = ids.shape[0]
    if T <= window:
        return float("nan")
    hits = total = 0
    rows = [set(r) for r in ids.tolist()]
    for t in range(T - window):
        later = set().union(*rows[t + 1 : t + 1 + window])
        hits += len(rows[t] & later)
        total += len(rows[t])
    return hits / total


def lru_hit_rate(ids: torch.Tensor, capacity: int) -> float:
    """Hit rate of an LRU cache of `capacity` experts fed the selections token by token.

    A token's experts are looked up together (one step); all are then the most recently used."""
    if capacity <= 0:
        return 0.0
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for row in ids.tolist():
        step = list(dict.fromkeys(row))
        for e in step:
            total += 1
            if e in cache:
                hits += 1
                cache.move_to_end(e)
        for e in step:
            cache[e] = None
            cache.move_to_end(e)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits / max(1, total)
