"""What an offloaded MoE layer step carries between its lookup and its kernel (experts/offload.py):
the guesses to prefetch, the slots it pinned, and a hybrid step's part on the CPU."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

Guess = tuple[int, torch.Tensor | None]  # (target MoE layer, guessed ids [T, K] on the device; None: a wrap guess)
Prefetch = tuple[Guess, list[int]]  # a guess and its distinct ids on the host (decode: most likely first)


@dataclass(frozen=True)
class CPUPart:
    """A hybrid step's pairs computed on the CPU: its `experts`, the running `job` (a [T, H] host
    tensor when done) and `off`, [T, K] bool on the cache's device: the pairs it covers, which the
    device kernel gives weight 0."""

    experts: list[int]
    job: Future
    off: torch.Tensor
    units: float  # what the split expects the job to cost, in 1-token experts (HybridSplit.units)


@dataclass(frozen=True)
class LayerStep:
    """A MoE layer step whose experts are acquired (pinned) and mapped to slots, ready for its
    kernel (run by `forward`, or by a per-layer CUDA graph after `prepare_decode`) until
    `OffloadExperts.finish_step`."""

    layer: int
    used: list[int]  # distinct expert ids on the device, ascending
    slots: list[int]  # their slots
    # [T, K] int32 slot of each (token, k) pair, on the cache's device; None when the CPU computes
    # every pair (a hybrid step with nothing on the device)
    slot_ids: torch.Tensor | None
    host_slot_ids: torch.Tensor | None  # the same on the host, when the ids were read there
    prefetches: list[Prefetch] = field(default_factory=list)  # guesses to copy once the kernel is issued
    streaming: bool = False
    cpu: CPUPart | None = None  # hybrid: what the CPU computes meanwhile
