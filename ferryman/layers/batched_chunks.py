"""A layer-major job's chunks through the batched MoE path with one dequantisation per expert group.

Layer-major prefill (engine/layer_prefill.py) runs one layer's MoE for every chunk of a job. The
batched path (batched_moe.py) dequantises each group of experts once per chunk: a 16k-token prompt
in 4096-token chunks dequantised every MXFP4 expert of gpt-oss-20b four times per layer (about
1 ms per layer and chunk on an H200). Here the chunks whose layouts hold the same group of experts
share it: the group's w13 is dequantised once and multiplied by each chunk's rows, then its w2.

Invariants:
- each chunk's result is bit for bit `fused_moe_batched` on that chunk alone: the same layout
  (groups, padding), the same GEMM shapes per (chunk, group), the same weight product, the same
  summation (sum_in_slot_order); only which dequantised copy a GEMM reads changes, and the
  dequantisers are deterministic;
- chunks are taken in windows whose held tensors (each chunk's pair outputs [P + 1, H], one
  group's activations for every chunk of the window, one chunk's inputs and gate_up of one group)
  fit what the planner counts for the job's largest chunk that the MoE may use (chunk_moe_bytes);
- chunk c's output is handed to emit(c, [T_c, H]) once every group of its window ran; x's rows of
  chunk c are read only before that, and by chunk c only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ferryman.layers.batched_moe import PaddedLayout, down, pair_bytes, padded_layout, prefill_group, up_act
from ferryman.layers.moe_common import MoEActivation, Upload, group_by_slot, sum_in_slot_order, to_device
from ferryman.quant import Banks, ExpertFormat

Emit = Callable[[int, torch.Tensor], None]  # (chunk index, its output [T_c, H])


@dataclass(frozen=True)
class ChunkLayout:
    """One chunk's pairs as the batched path lays them out: rows [a, b) of x, slot ids [T, K]."""

    index: int  # the chunk's position in the job (emit's first argument)
    a: int
    b: int
    ids: torch.Tensor  # [T, K] slot ids (device)
    weights: torch.Tensor  # [T, K]
    order: torch.Tensor  # [P] pair ids by slot (device)
    layout: PaddedLayout

    @property
    def pairs(self) -> int:
        return self.ids.numel()

    def groups(self) -> list[tuple[tuple[int, ...], int]]:
        """(the group's slots, its index in layout.groups) per group."""
        lay = self.layout
        return [(lay.host_slots[g0 : g0 + g], j) for j, (g0, g, _, _) in enumerate(lay.groups)]


def fused_moe_batched_chunks(form: ExpertFormat, banks: Banks, x: torch.Tensor, bounds: list[tuple[int, int]],
                             topk_ids: list[torch.Tensor], topk_w: list[torch.Tensor], act: MoEActivation,
                             emit: Emit, chunks: list[int] | None = None,
                             host_ids: list[torch.Tensor | None] | None = None,
                             inputs_issued: Callable[[], None] | None = None,
                             upload: Upload | None = None, group: int | None = None) -> None:
    """x [T, H] holds every chunk's rows, chunk c at rows bounds[c] with slot ids topk_ids[c] and
    weights topk_w[c] [T_c, K]; for each chunk c of `chunks` (default all), emit(c, out [T_c, H]),
    out as fused_moe_batched(x[bounds[c]], topk_ids[c], topk_w[c]) gives it. host_ids[c]: the same
    ids on the host, or None. inputs_issued: called once every chunk's layout is on its way.
    group: experts per launch (default `prefill_group` of the banks' shape), as fused_moe_batched's."""
    num_slots, hidden, inter = form.dims(banks)
    group = prefill_group(inter, hidden, x.element_size()) if group is None else group
    todo = list(range(len(bounds))) if chunks is None else chunks
    laid = []
    for c in todo:
        slots, order, counts = group_by_slot(topk_ids[c], num_slots, None if host_ids is None else host_ids[c], upload)
        lay = padded_layout(slots, counts, group, upload or to_device(x.device))
        laid.append(ChunkLayout(c, *bounds[c], topk_ids[c], topk_w[c], order, lay))
    if inputs_issued is not None:
        inputs_issued()
    K = topk_ids[0].shape[1] if topk_ids else 0
    tokens = max((b - a for a, b in (bounds[c] for c in todo)), default=0)
    budget = chunk_moe_bytes(tokens, K, hidden, inter, x.element_size())
    for window in chunk_windows(laid, hidden, inter, x.element_size(), budget):
        _run_window(form, banks, x, act, window, emit)


def chunk_moe_bytes(tokens: int, top_k: int, hidden: int, inter: int, itemsize: int) -> int:
    """What planner.activation_bytes counts for a prefill chunk of `tokens` that a layer-major job's
    MoE may hold: `pair_bytes` per pair and the chunk's block outputs (6 H per token), which in a
    job live in its own [T, H] buffers (planner.prefill_job_bytes) and not beside the MoE."""
    return tokens * (top_k * pair_bytes(hidden, inter, itemsize) + 6 * hidden * itemsize)


def window_bytes(chunks: list[ChunkLayout], hidden: int, inter: int, itemsize: int) -> int:
    """What a window of chunks holds at its peak: each chunk's pair outputs, the largest group's
    activations over the window, and one (chunk, group)'s inputs and gate_up (its output, made
    once they are freed, is smaller)."""
    held = sum((c.pairs + 1) * hidden for c in chunks)
    per_group: dict[tuple[int, ...], int] = {}
    one = 0
    for c in chunks:
        for key, j in c.groups():
            _, g, m, _ = c.layout.groups[j]
            per_group[key] = per_group.get(key, 0) + g * m * inter
            one = max(one, g * m * (hidden + 2 * inter))
    return itemsize * (held + max(per_group.values(), default=0) + one)


def chunk_windows(chunks: list[ChunkLayout], hidden: int, inter: int, itemsize: int,
                  budget: int) -> list[list[ChunkLayout]]:
    """Consecutive chunks, as many to a window as fit `budget` bytes (window_bytes), one at least."""
    out: list[list[ChunkLayout]] = []
    for c in chunks:
        if out and window_bytes([*out[-1], c], hidden, inter, itemsize) <= budget:
            out[-1].append(c)
        else:
            out.append([c])
    return out


def _run_window(form: ExpertFormat, banks: Banks, x: torch.Tensor, act: MoEActivation,
                window: list[ChunkLayout], emit: Emit) -> None:
    hidden = x.shape[1]
    prep = [_ChunkState.of(c, banks, form, x) for c in window]
    members: dict[tuple[int, ...], list[tuple[_ChunkState, int]]] = {}  # group's slots -> (chunk, group index)
    for s in prep:
        for key, j in s.chunk.groups():
            members.setdefault(key, []).append((s, j))
    for runs in members.values():
        first, j0 = runs[0]
        g0, g, _, _ = first.chunk.layout.groups[j0]
        sel = first.chunk.layout.slots[g0 : g0 + g]  # [G]
        w13 = form.dequant(banks, "w13", sel, x.dtype)  # [G, 2I, H], shared by the runs
        hs = [up_act(w13, s.inputs(x, j), act, s.bias(0, j)) for s, j in runs]  # [G, m, I] each
        del w13
        w2 = form.dequant(banks, "w2", sel, x.dtype)  # [G, H, I]
        for (s, j), h in zip(runs, hs):
            _, g, m, r0 = s.chunk.layout.groups[j]
            rows = slice(r0, r0 + g * m)
            y = torch.empty((g, m, hidden), dtype=x.dtype, device=x.device)  # [G, m, H]
            down(w2, h, s.bias(1, j), y)
            # weight product in the promoted dtype, then one rounding to x.dtype, as the batched path
            torch.mul(y, s.w[rows].view(g, m, 1), out=y)
            s.y_pairs.index_copy_(0, s.sink[rows], y.view(g * m, hidden))
        del w2, hs
    for s in prep:
        T, K = s.chunk.ids.shape
        emit(s.chunk.index, sum_in_slot_order(s.y_pairs[: T * K].view(T, K, hidden), s.chunk.ids))


@dataclass
class _ChunkState:
    """A chunk's device tensors while its window runs (batched_moe.fused_moe_batched's, per chunk)."""

    chunk: ChunkLayout
    rows_of: torch.Tensor  # [R] x row of each padded row
    w: torch.Tensor  # [R] pair weight, 0 on padding rows
    sink: torch.Tensor  # [R] output row: the pair id, or P (a spare row) for padding
    y_pairs: torch.Tensor  # [P + 1, H]
    biases: tuple[torch.Tensor, torch.Tensor] | None  # the used slots' (w13 [U, 2I], w2 [U, H]) biases

    @staticmethod
    def of(c: ChunkLayout, banks: Banks, form: ExpertFormat, x: torch.Tensor) -> _ChunkState:
        K, P, lay = c.ids.shape[1], c.pairs, c.layout
        pair = c.order[lay.rows]  # [R] pair id (t*K + k) of each padded row
        w = torch.where(lay.valid, c.weights.reshape(-1)[pair], 0.0)  # [R]
        bias = None
        if form.has_bias(banks):
            bias = banks["w13_bias"][lay.slots].to(x.dtype), banks["w2_bias"][lay.slots].to(x.dtype)
        y_pairs = torch.empty((P + 1, x.shape[1]), dtype=x.dtype, device=x.device)
        return _ChunkState(c, pair // K + c.a, w, torch.where(lay.valid, pair, P), y_pairs, bias)

    def inputs(self, x: torch.Tensor, j: int) -> torch.Tensor:
        """Group j's padded input rows [G, m, H]."""
        _, g, m, r0 = self.chunk.layout.groups[j]
        return x[self.rows_of[r0 : r0 + g * m]].view(g, m, x.shape[1])

    def bias(self, which: int, j: int) -> torch.Tensor | None:
        """Group j's w13 (0) or w2 (1) biases, [G, 2I] or [G, H]."""
        g0, g, _, _ = self.chunk.layout.groups[j]
        return None if self.biases is None else self.biases[which][g0 : g0 + g]
