"""Prefill-sized MoE in groups of experts: padded batched GEMMs instead of a loop of small ones.

`fused_moe_batched` computes what `fused_moe_reference` computes with `group` experts per launch.
The reference launches ~20 kernels per expert; on the H200 a gpt-oss prefill chunk cost about
0.5-0.6 ms per expert whether the expert had 64 or 256 tokens (docs/benchmarks.md), which points
at a host-bound loop. Here a group's pairs are padded to its longest run (`[G, m, H]`), its
weights dequantised together (`[G, 2I, H]`), and two `torch.bmm` do the products.

Invariants:
- padding rows read a real row of their own expert (finite values), get weight 0, and are written
  to a spare row P of the output that nothing reads;
- each token sums its K expert outputs in ascending slot order in x.dtype, starting from zero, as
  the reference's index_add_ sequence does; only the GEMMs (bmm against mm) may round differently.
Memory: `group` experts dequantised at once (3 I H values each, in the compute dtype), counted by
the planner when this path is selected (FERRYMAN_MOE_PREFILL=batched, CUDA; not yet measured).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from ferryman.layers.fused_moe import MoEActivation, _group_by_slot, apply_activation, sum_in_slot_order
from ferryman.quant import Banks, ExpertFormat

def default_group() -> int:
    """Experts per launch (FERRYMAN_MOE_PREFILL_GROUP, default 4)."""
    from ferryman.envs import envs

    return envs.MOE_PREFILL_GROUP


def fused_moe_batched(form: ExpertFormat, banks: Banks, x: torch.Tensor, topk_ids: torch.Tensor,
                      topk_w: torch.Tensor, act: MoEActivation, group: int | None = None) -> torch.Tensor:
    """x [T, H], topk_ids [T, K] slot ids, topk_w [T, K] -> [T, H] in x.dtype."""
    group = default_group() if group is None else group
    if group < 1:
        raise ValueError(f"fused_moe_batched: group must be >= 1, got {group}")
    T, K = topk_ids.shape
    num_slots, hidden, _ = form.dims(banks)
    slots, order, counts = _group_by_slot(topk_ids, num_slots)
    P = T * K
    tokens_sorted = order // K  # [P] pairs sorted by slot
    w_sorted = topk_w.reshape(-1)[order]  # [P]
    x_sorted = x[tokens_sorted]  # [P, H]
    y_sorted = torch.empty((P + 1, hidden), dtype=x.dtype, device=x.device)  # row P: padding sink
    groups = _padded_groups(slots, counts, group, x.device)
    zero = w_sorted.new_zeros(())
    for sel, idx, valid in groups:  # sel [G] slots, idx / valid [G, m]
        y = _group_forward(form, banks, sel, x_sorted[idx], act)  # [G, m, H]
        # weight product in the promoted dtype, then one rounding to x.dtype, as the reference
        y = (y * torch.where(valid, w_sorted[idx], zero)[..., None]).to(x.dtype)
        sink = torch.where(valid, idx, torch.full_like(idx, P))
        y_sorted.index_copy_(0, sink.reshape(-1), y.reshape(-1, hidden))
    y_pairs = torch.empty_like(y_sorted[:P]).index_copy_(0, order, y_sorted[:P])  # pair p = t*K + k
    return sum_in_slot_order(y_pairs.view(T, K, hidden), topk_ids)


def _padded_groups(slots: list[int], counts: list[int], group: int,
                   device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per group of `group` experts: (slots [G], idx [G, m], valid [G, m]): rows of the slot-sorted
    pair axis of each expert, padded to the group's longest run (a padding entry repeats its
    expert's first row). Built on the host and moved in one asynchronous copy: a tensor made on
    the device from a list would synchronise the stream once per group."""
    starts = [0, *accumulate(counts)][:-1]  # first sorted row of each expert
    shapes, parts = [], [torch.tensor(slots)]
    for g0 in range(0, len(slots), group):
        cnt = torch.tensor(counts[g0 : g0 + group])[:, None]  # [G, 1]
        first = torch.tensor(starts[g0 : g0 + group])[:, None]
        ar = torch.arange(int(cnt.max()))[None, :]  # [1, m]
        valid = ar < cnt
        parts += [torch.where(valid, first + ar, first).reshape(-1), valid.reshape(-1).long()]
        shapes.append((g0, *valid.shape))
    flat = torch.cat(parts).to(device, non_blocking=True)  # one host -> device copy
    out, pos = [], len(slots)
    for g0, g, m in shapes:
        idx = flat[pos : pos + g * m].view(g, m)
        valid = flat[pos + g * m : pos + 2 * g * m].view(g, m).bool()
        out.append((flat[g0 : g0 + g], idx, valid))
        pos += 2 * g * m
    return out


def _group_forward(form: ExpertFormat, banks: Banks, sel: torch.Tensor, xs: torch.Tensor,
                   act: MoEActivation) -> torch.Tensor:
    """Experts `sel` [G] (slot ids) on their padded rows xs [G, m, H] -> [G, m, H] in xs.dtype."""
    bias = form.has_bias(banks)
    w13 = form.dequant(banks, "w13", sel, xs.dtype)  # [G, 2I, H], transient
    gate_up = torch.bmm(xs, w13.transpose(1, 2))  # [G, m, 2I]
    del w13
    if bias:  # after the product, as the reference (HF: x @ W + b)
        gate_up = gate_up + banks["w13_bias"][sel].to(xs.dtype)[:, None, :]
    h = apply_activation(gate_up, act)  # [G, m, I]
    w2 = form.dequant(banks, "w2", sel, xs.dtype)  # [G, H, I], transient
    y = torch.bmm(h, w2.transpose(1, 2))  # [G, m, H]
    if bias:
        y = y + banks["w2_bias"][sel].to(xs.dtype)[:, None, :]
    return y
