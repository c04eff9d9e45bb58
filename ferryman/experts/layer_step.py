"""A MoE layer step being carried out (experts/offload.py): its plan, the slots it pinned, the slot
ids its kernel reads, and a hybrid step's part on the CPU."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ferryman.experts.plan import LayerPlan


@dataclass(frozen=True)
class CPUPart:
    """A hybrid step's pairs computed on the CPU: the running `job` (a [T, H] host tensor when
    done) and `off`, [T, K] bool on the cache's device: the pairs it covers, which the device
    kernel gives weight 0."""

    job: Future
    off: torch.Tensor


@dataclass(frozen=True)
class LayerStep:
    """A step whose experts are acquired (pinned) and mapped to slots, ready for its kernel (run by
    `forward`, or by a per-layer CUDA graph after `prepare_decode`) until `finish_step`."""

    plan: LayerPlan
    slots: list[int]  # the slots of plan.device
    # [T, K] int32 slot of each (token, k) pair, on the cache's device; None when the CPU computes
    # every pair (a hybrid step with nothing on the device)
    slot_ids: torch.Tensor | None
    host_slot_ids: torch.Tensor | None  # the same on the host, when the ids were read there
    cpu: CPUPart | None = None  # hybrid: what the CPU computes meanwhile
    prefetched: bool = False  # the plan's prefetch copies have started

    @property
    def layer(self) -> int:
        return self.plan.layer
