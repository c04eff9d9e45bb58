"""Where each expert's row of bytes is, for zero-copy decode (FERRYMAN_ZERO_COPY).

The decode kernel reads expert e of a layer at `addr[key(layer, e)]` (layers/fused_moe_triton.py,
RowAddresses): its cache slot on the device, or its row in pinned host memory, which the kernel
reads over the link (unified virtual addressing). No host sync per layer and no copy on the
critical path, so a whole decode step can be one CUDA graph.

Invariants, kept together with ExpertCache's copy ordering:
- an entry names a slot only after the compute stream waited for that slot's copy (`point`, called
  by `ExpertCache.acquire` after `Transfer.wait`): a kernel never reads a slot before it landed;
- before a slot is refilled, its old expert's entry returns to host memory on the compute stream,
  and the copy into the slot waits for an event recorded after that update (`unpoint`): every
  kernel enqueued earlier, graph replays included, has finished reading the slot by then.
A host row is always valid, so an entry that lags behind the cache costs speed, never correctness.
"""

from __future__ import annotations

import torch

from ferryman.experts.host_store import HostExpertStore
from ferryman.layers.fused_moe import DECODE_MAX_PAIRS


class RowAddressTable:
    """Keys are flat expert ids over the MoE layers, `moe_index[layer] * E + expert` (gpu_cache)."""

    def __init__(self, store: HostExpertStore, slot_rows: torch.Tensor, moe_index: dict[int, int],
                 max_pairs: int = DECODE_MAX_PAIRS) -> None:
        # slot_rows: the expert-major slot pool [S, row_bytes] on the device
        layout = store.layout
        if layout is None or slot_rows.dim() != 2 or slot_rows.shape[1] != layout.row_bytes:
            raise ValueError("row addresses need the expert-major slot pool of the same row layout")
        self.num_experts, self.row_bytes = store.cfg.num_experts, layout.row_bytes
        self.device = slot_rows.device
        e = self.num_experts
        self.host = torch.empty(len(moe_index) * e, dtype=torch.int64)  # key -> host row address
        rows = torch.arange(e, dtype=torch.int64) * self.row_bytes
        for layer, i in moe_index.items():
            self.host[i * e : (i + 1) * e] = store.flat[layer].data_ptr() + rows
        self.slot_base = slot_rows.data_ptr()
        self.addr = self.host.to(self.device, copy=True)  # [keys] int64: what the kernels read (never aliases host)
        # the expert ids each MoE layer's zero-copy call used, written in the (graph-captured) step and
        # read by the host after it: [layers, max_pairs]
        self.seen = torch.zeros((len(moe_index), max_pairs), dtype=torch.int64, device=self.device)

    def layer(self, index: int) -> torch.Tensor:
        """The [E] addresses of the MoE layer with this index (a view: updates show through)."""
        return self.addr[index * self.num_experts : (index + 1) * self.num_experts]

    def record(self, index: int, expert_ids: torch.Tensor) -> None:
        """Keep what MoE layer `index` read this step (no sync: a device copy, graph-capturable)."""
        flat = expert_ids.reshape(-1)  # [P]
        self.seen[index, : flat.numel()].copy_(flat)

    def point(self, keys: list[int], slots: list[int]) -> None:
        """`keys` are in `slots` and their copies waited for on the compute stream."""
        if keys:
            values = self.slot_base + torch.tensor(slots, dtype=torch.int64) * self.row_bytes
            self._set(keys, values)

    def unpoint(self, keys: list[int]) -> torch.cuda.Event | None:
        """`keys` lose their slots: back to host rows; the event to wait for before refilling them."""
        if not keys:
            return None
        self._set(keys, self.host[torch.tensor(keys, dtype=torch.int64)])
        if self.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def _set(self, keys: list[int], values: torch.Tensor) -> None:
        idx = torch.tensor(keys, dtype=torch.int64)
        # fresh pageable tensors: the async copies stage them at once, nothing reuses their memory
        self.addr.index_copy_(0, idx.to(self.device, non_blocking=True), values.to(self.device, non_blocking=True))
