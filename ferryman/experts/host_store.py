"""Host expert store: every routed expert in (pinned) host memory, each expert's banks contiguous.

Layout of one MoE layer: a flat uint8 buffer `[E, row_bytes]`; row e holds all banks of expert e
back to back (`ExpertLayout.offsets`, each bank aligned to quant.layout.ALIGN bytes), and the usual
`banks[layer][name]: [E, ...]` are strided views into it, so the loader and the reference
kernels see an ordinary `ExpertStore`. Fetching expert e is one copy of row e.

Pinned memory is what lets host -> GPU copies run asynchronously at link speed. If pinning fails
(a locked-memory quota: WSL, Windows, containers), the layers that did not fit stay pageable and a
warning says how many: correct, but each copy is synchronous with the host and several times slower.
"""

from __future__ import annotations

import logging
import time

import torch

from ferryman.config import ModelConfig
from ferryman.experts.store import ExpertStore
from ferryman.quant.base import BankSpec
from ferryman.quant.layout import ExpertLayout, allocate_rows

log = logging.getLogger("ferryman.experts")

class HostExpertStore(ExpertStore):
    """An `ExpertStore` in host memory whose banks are views of one expert-major buffer per layer."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pin: bool) -> None:
        self.want_pin = pin
        self.flat: dict[int, torch.Tensor] = {}  # layer -> [E, row_bytes] uint8
        self.pinned_layers = 0
        self.layout: ExpertLayout | None = None  # the widest layer's (a GPU slot holds any layer's expert)
        self.layouts: dict[int, ExpertLayout] = {}  # each layer's (one for all but mixed-format models)
        self._pin_failed = False
        start = time.perf_counter()
        super().__init__(cfg, dtype, "cpu")
        log.info("experts in host RAM: %.2f GiB over %d MoE layers, %s (%.1f s)",
                 sum(f.numel() for f in self.flat.values()) / 2**30, len(self.flat),
                 _pin_state(self), time.perf_counter() - start)
        if pin and self._pin_failed:
            log.warning(
                "could not pin host memory for the experts of %d of %d MoE layers (locked-memory "
                "quota?); those experts are copied from pageable memory: slower (synchronous, "
                "~7-13 GB/s instead of ~50 GB/s) but correct",
                len(self.flat) - self.pinned_layers, len(self.flat),
            )

    def _allocate_layer(self, layer: int, specs: dict[str, BankSpec]) -> dict[str, torch.Tensor]:
        layout = ExpertLayout.of(specs)
        # after one failure stop trying: every further attempt would fail the same way, slowly
        flat, pinned = allocate_rows(self.cfg.num_experts, layout.row_bytes, self.want_pin and not self._pin_failed)
        self._pin_failed |= self.want_pin and not pinned
        self.pinned_layers += int(pinned)
        self.flat[layer], self.layouts[layer] = flat, layout
        if self.layout is None or layout.row_bytes > self.layout.row_bytes:
            self.layout = layout
        return layout.views(flat)

    @property
    def pinned(self) -> bool:
        return self.pinned_layers == len(self.flat)


def _pin_state(store: HostExpertStore) -> str:
    if not store.want_pin:
        return "pageable (the CPU is the device)"
    return "pinned" if store.pinned else f"{store.pinned_layers} of {len(store.flat)} layers pinned"
