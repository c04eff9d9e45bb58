"""Resident experts: every expert lives in device memory, expert id == slot id."""

from __future__ import annotations

import torch

from ferryman.experts.store import ExpertStore
from ferryman.layers.fused_moe import MoEActivation, fused_moe


class ResidentExperts:
    def __init__(self, store: ExpertStore, act: MoEActivation) -> None:
        self.store, self.act = store, act
        self.fmt = store.format.name

    def begin_step(self) -> None:
        """Nothing to do per step: every expert is in place."""

    def end_step(self) -> None:
        """Nothing to do per step."""

    def note_step(self, seconds: float, batch: int, decode_only: bool) -> None:
        """Nothing is timed: there is no split to try."""

    def restart_trials(self) -> None:
        """No trial runs here."""

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor
    ) -> torch.Tensor:
        # x: [T, H]; topk_ids/topk_w: [T, K]; slots == expert ids here
        return fused_moe(self.store.formats[layer].name, self.store.banks[layer], x, topk_ids, topk_w, self.act)
