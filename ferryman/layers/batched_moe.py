"""Prefill-sized MoE in groups of experts: padded batched GEMMs instead of a loop of small ones.

`fused_moe_batched` computes what `fused_moe_reference` computes, `group` experts per launch: the
rows of every group are gathered once, each group's experts dequantised together (`[G, 2I, H]`,
read in place from the slot banks) and multiplied by two `torch.bmm`, and the outputs go to their
tokens' summing rows in one scatter. The layout is built on the host (numpy) and uploaded in one
copy; with the ids on the host already (host ids), a layer needs no sync.

Invariants:
- padding rows read a real row of their own expert (finite values) and are written to a spare row
  P of the output that nothing reads;
- each token sums its K expert outputs in ascending slot order in x.dtype, starting from zero, as
  the reference's index_add_ sequence does; only the GEMMs (bmm against mm) and, on CUDA with
  Triton, the bias and activation (one fused kernel in fp32, rounded once: `bias_act`) may round
  differently. On CUDA with Triton the weighting and the sums are one kernel (`rank_sum`), with the
  torch ops' roundings in their order.
Memory: `group` experts' w13 dequantised at once (2 I H values each, freed before w2 is made), as
the planner counts it (planner.activation_bytes). The group is sized in bytes (`prefill_group`):
small experts go many to a launch, since a layer of hundreds of few-token experts (qwen3-next's
512) is otherwise bound by launches, not by the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ferryman.layers import backend
from ferryman.layers.moe_common import (MoEActivation, Upload, apply_activation, check_host_ids, group_on_host,
                                        to_device)
from ferryman.quant import Banks, ExpertFormat

PREFILL_GROUP = 8  # fewest experts dequantised and multiplied per launch (the planner counts their w13)
PREFILL_GROUP_MAX = 64  # most experts per launch
PREFILL_GROUP_BYTES = 256 << 20  # a group's dequantised w13 up to this size, when above PREFILL_GROUP experts


def prefill_group(intermediate: int, hidden: int, itemsize: int) -> int:
    """Experts per launch for experts of this shape: as many as PREFILL_GROUP_BYTES of dequantised w13
    (2 I H values each) hold, within PREFILL_GROUP .. PREFILL_GROUP_MAX."""
    fit = PREFILL_GROUP_BYTES // max(2 * intermediate * hidden * itemsize, 1)
    return max(PREFILL_GROUP, min(PREFILL_GROUP_MAX, fit))


def fused_moe_batched(form: ExpertFormat, banks: Banks, x: torch.Tensor, topk_ids: torch.Tensor,
                      topk_w: torch.Tensor, act: MoEActivation, group: int | None = None,
                      host_ids: torch.Tensor | None = None,
                      inputs_issued: Callable[[], None] | None = None,
                      upload: Upload | None = None) -> torch.Tensor:
    """x [T, H], topk_ids [T, K] slot ids, topk_w [T, K] -> [T, H] in x.dtype. host_ids, upload:
    as `fused_moe`'s (without host ids, topk_ids are read back once). inputs_issued: called once the
    layout's host -> device copy is issued, before the groups' launches (the caller's large copies
    then delay no input of these kernels). group: experts per launch (default `prefill_group` of the
    banks' shape)."""
    num_slots, hidden, inter = form.dims(banks)
    group = prefill_group(inter, hidden, x.element_size()) if group is None else group
    if group < 1:
        raise ValueError(f"fused_moe_batched: group must be >= 1, got {group}")
    check_host_ids(topk_ids, host_ids)
    T, K = topk_ids.shape
    P = T * K
    ids = (topk_ids.cpu() if host_ids is None else host_ids).numpy()  # [T, K] on the host
    slots, order, counts = group_on_host(ids.reshape(-1), num_slots)
    layout = padded_layout(slots, counts, group)
    pair = order[layout.rows]  # [R] pair id (t*K + k) of each padded row
    rank = summing_rows(order, K)[layout.rows]  # [R] output row t*K + r of each padded row (valid ones)
    fused = backend.moe_fused_act(x)  # the weights and the sums in one kernel (moe_act_triton.rank_sum)
    # fused: [P] the padded row of each output row; else [R] each padded row's output row (padding: spare row P)
    tail = rank_sources(rank, layout.valid, P) if fused else np.where(layout.valid, rank, P)
    U, R = len(layout.slots), len(pair)
    # fused with biases: each padded row's slot (its w2 bias row in the bank)
    biased = form.has_bias(banks)
    row_slots = layout.slots[row_experts(layout.groups)] if fused and biased else np.zeros(0, np.int64)
    arrays = (layout.slots, pair // K, pair, row_slots, tail)
    flat = (upload or to_device(x.device))(torch.from_numpy(np.concatenate(arrays)))
    if inputs_issued is not None:
        inputs_issued()
    used, tok, pair_d, row_slots_d, tail_d = torch.split(flat, [len(a) for a in arrays])
    xs = x[tok]  # [R, H], all groups' inputs in one gather
    # [R]; a padding row's weight is its pair's, its output goes to row P
    w = None if fused else topk_w.reshape(-1)[pair_d]
    y = torch.empty((R, hidden), dtype=x.dtype, device=x.device)  # [R, H]
    bias = None  # the used slots' biases [U, 2I] and [U, H] in the compute dtype (fused: read in the banks)
    if biased and not fused:
        bias = banks["w13_bias"][used].to(x.dtype), banks["w2_bias"][used].to(x.dtype)
    for g0, g, m, r0 in layout.groups:
        rows = slice(r0, r0 + g * m)
        y_g = y[rows].view(g, m, hidden)
        # fused: w13's bias read by bias_act from the bank, w2's added by rank_sum
        b = (banks["w13_bias"], None) if fused and biased else \
            None if bias is None else (bias[0][g0 : g0 + g], bias[1][g0 : g0 + g])
        _group_forward(form, banks, used[g0 : g0 + g], xs[rows].view(g, m, hidden), act, b, out=y_g,
                       bank_bias=fused)
        if w is not None:
            y_g.mul_(w[rows].view(g, m, 1))  # the weight product in the promoted dtype, one rounding to x.dtype
    del xs  # [R, H], and y below once placed: the peak stays at the groups' loop
    if fused:
        from ferryman.layers.moe_act_triton import rank_sum

        # bit for bit the w2 bias add, the weighting and the three steps below
        return rank_sum(y, topk_w, pair_d, tail_d, K, (banks["w2_bias"], row_slots_d) if biased else None)
    ranked = torch.empty((P + 1, hidden), dtype=x.dtype, device=x.device).index_copy_(0, tail_d, y)[:P]
    del y
    return sum_ranked(ranked.view(T, K, hidden))


def row_experts(groups: list[tuple[int, int, int, int]]) -> np.ndarray:
    """[R] each padded row's expert, as an index into the layout's used slots."""
    parts = [np.repeat(np.arange(g0, g0 + g, dtype=np.int64), m) for g0, g, m, _ in groups]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def rank_sources(rank: np.ndarray, valid: np.ndarray, pairs: int) -> np.ndarray:
    """[R] output row of each padded row (the valid ones') -> [pairs]: the padded row of each output
    row (valid rows and output rows correspond one to one)."""
    src = np.empty(pairs, dtype=np.int64)
    src[rank[valid]] = np.flatnonzero(valid)
    return src


def summing_rows(order: np.ndarray, k: int) -> np.ndarray:
    """order [P] (pair ids t*K + k by ascending slot, ties in pair order) -> [P]: the output row of
    each sorted position, t*K + r with r its rank among token t's pairs in that order, so row t*K + r
    holds token t's r-th term. A token's pairs come in rank order along `order`, so a stable sort of
    their tokens lists row t*K + r at its place (one radix sort for 16-bit token numbers)."""
    tokens = order // k
    keys = tokens.astype(np.int16 if order.size // k <= 2**15 else np.int32, copy=False)  # tokens < T
    rows = np.empty_like(order)
    rows[np.argsort(keys, kind="stable")] = np.arange(order.size)
    return rows


def sum_ranked(y: torch.Tensor) -> torch.Tensor:
    """y [T, K, H], each token's terms in ascending slot order -> [T, H]: added one by one in that
    order, as the reference's (and transformers') index_add_ from zero accumulates them."""
    out = y[:, 0].clone() if y.shape[1] == 1 else y[:, 0] + y[:, 1]
    for k in range(2, y.shape[1]):
        out += y[:, k]
    return out


# Padding rows a layout may add, as a share of the real rows, before experts are regrouped by run
# length (skewed routing pads groups in slot order far past the planned memory)
PAD_SLACK = 0.25


@dataclass(frozen=True)
class PaddedLayout:
    """The slot-sorted pairs, regrouped: at most `group` experts at a time, each expert's run padded
    to the group's longest run. Group j holds g experts x m rows at rows r0 .. r0 + g*m; its experts
    are slots[g0 : g0 + g]."""

    slots: np.ndarray  # [U] used slots in group order
    rows: np.ndarray  # [R] slot-sorted pair row of each padded row
    valid: np.ndarray  # [R] bool: a real pair, not padding
    groups: list[tuple[int, int, int, int]]  # (first expert g0, experts g, rows per expert m, first row r0)


def slot_order_groups(count: int, group: int) -> list[list[int]]:
    """Indices 0 .. count - 1 (the used experts, ascending slot), `group` at a time."""
    return [list(range(g0, min(g0 + group, count))) for g0 in range(0, count, group)]


def padded_rows(counts: list[int], groups: list[list[int]]) -> int:
    """Rows of a layout of `groups` (indices into `counts`): each run padded to its group's longest."""
    return sum(len(g) * max(counts[e] for e in g) for g in groups)


def expert_groups(counts: list[int], group: int) -> list[list[int]]:
    """Indices into `counts` (each used expert's pairs), `group` at a time in slot order; or, when
    that pads more than PAD_SLACK of the pairs, the longest runs first, a group closing before an
    expert that would take its padding past PAD_SLACK of its rows (so R <= (1 + PAD_SLACK) P)."""
    in_order = slot_order_groups(len(counts), group)
    pairs = sum(counts)
    if padded_rows(counts, in_order) - pairs <= PAD_SLACK * pairs:
        return in_order
    out: list[list[int]] = []
    filled = 0  # pairs of the group being filled, out[-1]
    for e in sorted(range(len(counts)), key=lambda e: -counts[e]):
        cur = out[-1] if out else None
        if cur is not None and len(cur) < group and \
                (len(cur) + 1) * counts[cur[0]] <= (1 + PAD_SLACK) * (filled + counts[e]):
            cur.append(e)
            filled += counts[e]
        else:
            out.append([e])
            filled = counts[e]
    return out


def padded_layout(slots: list[int], counts: list[int], group: int) -> PaddedLayout:
    """Built on the host (numpy; the caller uploads it with its other indices in one copy). A
    padding row repeats its expert's first row (finite)."""
    starts = np.cumsum([0, *counts[:-1]])  # first sorted row of each expert
    rows, valid, groups, order, r0 = [], [], [], [], 0
    for members in expert_groups(counts, group):
        cnt = np.asarray([counts[e] for e in members])[:, None]  # [g, 1]
        first = starts[members][:, None]
        ok = np.arange(cnt.max())[None, :] < cnt  # [g, m]
        rows.append(np.where(ok, first + np.arange(ok.shape[1])[None, :], first).reshape(-1))
        valid.append(ok.reshape(-1))
        groups.append((len(order), ok.shape[0], ok.shape[1], r0))
        order += [slots[e] for e in members]
        r0 += ok.size
    if not groups:  # no pair
        return PaddedLayout(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool), [])
    return PaddedLayout(np.asarray(order, dtype=np.int64), np.concatenate(rows), np.concatenate(valid), groups)


def _group_forward(form: ExpertFormat, banks: Banks, sel: torch.Tensor, xs: torch.Tensor, act: MoEActivation,
                   bias: tuple[torch.Tensor, torch.Tensor | None] | None, out: torch.Tensor,
                   bank_bias: bool = False) -> None:
    """Experts `sel` [G] (slot ids) on their padded rows xs [G, m, H] -> out [G, m, H] in xs.dtype.
    bias: their (w13 [G, 2I], w2 [G, H] or None: the caller adds it) biases in xs.dtype, added after
    each product (HF: x @ W + b); bank_bias (the fused activation only): w13's is the bank [S, 2I]
    itself, read at rows `sel`."""
    w13 = form.dequant(banks, "w13", sel, xs.dtype)  # [G, 2I, H], transient
    gate_up = torch.bmm(xs, w13.transpose(1, 2))  # [G, m, 2I]
    del w13  # freed before w2 is made: the planner counts 2 I H per expert of the group
    if backend.moe_fused_act(xs):
        from ferryman.layers.moe_act_triton import bias_act

        b13 = None if bias is None else bias[0]
        rows = sel if bank_bias and b13 is not None else None  # the bank's rows of the group's experts
        h = bias_act(gate_up, b13, act.kind, act.alpha, act.limit, rows)  # [G, m, I]
    else:
        if bias is not None:
            gate_up += bias[0][:, None, :]
        h = apply_activation(gate_up, act)  # [G, m, I]
    del gate_up
    w2 = form.dequant(banks, "w2", sel, xs.dtype)  # [G, H, I], transient
    torch.bmm(h, w2.transpose(1, 2), out=out)  # [G, m, H]
    if bias is not None and bias[1] is not None:
        out += bias[1][:, None, :]
