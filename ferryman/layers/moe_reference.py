"""Torch paths of `fused_moe`: the reference, experts one at a time in ascending slot order, each
dequantised alone, the casts in transformers' order (GptOssExperts / Qwen3MoeExperts: compute in
x.dtype, product with the weight, then index_add); and, for a CPU step of few pairs, the gathered
batch of experts."""

from __future__ import annotations

import torch

from ferryman.layers.moe_common import (MoEActivation, apply_activation, check_slot_range, group_by_slot,
                                        sum_in_slot_order)
from ferryman.quant import Banks, ExpertFormat

# Dense experts at least this large are multiplied in place (views of the bank, no gathered copy):
# for big experts the copy costs as much memory traffic as the product itself.
IN_PLACE_MIN_BYTES = 1 << 20


def project(form: ExpertFormat, banks: Banks, proj: str, slot: int, xs: torch.Tensor) -> torch.Tensor:
    """xs [n, in] @ W_proj[slot]^T -> [n, out] in xs.dtype, the weights dequantised for the call."""
    w = form.dequant(banks, proj, slice(slot, slot + 1), xs.dtype)[0]  # [out, in], transient
    return xs @ w.T


def expert_forward(form: ExpertFormat, banks: Banks, slot: int, xs: torch.Tensor,
                   act: MoEActivation) -> torch.Tensor:
    """One expert on its tokens. slot: a host int (views of the banks: no gather, no device sync),
    xs: [n, H] -> [n, H] in xs.dtype."""
    bias = form.has_bias(banks)
    gate_up = project(form, banks, "w13", slot, xs)  # [n, 2I]
    if bias:  # added after the matmul, not fused (HF: x @ W + b)
        gate_up = gate_up + banks["w13_bias"][slot].to(xs.dtype)
    h = apply_activation(gate_up, act)  # [n, I]
    y = project(form, banks, "w2", slot, h)  # [n, H]
    if bias:
        y = y + banks["w2_bias"][slot].to(xs.dtype)
    return y


def fused_moe_reference(form: ExpertFormat, banks: Banks, x: torch.Tensor, topk_ids: torch.Tensor,
                        topk_w: torch.Tensor, act: MoEActivation,
                        host_ids: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype. host_ids: the ids on the host too (then no device read)."""
    num_slots, _, _ = form.dims(banks)
    k = topk_ids.shape[1]
    out = torch.zeros_like(x)  # [T, H]
    slots, order, counts = group_by_slot(topk_ids, num_slots, host_ids)
    # pairs sorted by slot, gathered once: each expert then takes slices (views, no launches)
    tokens_sorted = order // k  # [P]
    w_sorted = topk_w.reshape(-1)[order]  # [P]
    x_sorted = x[tokens_sorted]  # [P, H]
    start = 0
    for u, n in enumerate(counts):
        part = slice(start, start + n)  # the pairs routed to this slot
        start += n
        y = expert_forward(form, banks, slots[u], x_sorted[part], act)  # [n, H]
        # weight product in the promoted dtype (fp32 weights: one rounding, as HF with
        # weights already in x.dtype), then accumulate in x.dtype like HF's index_add_
        y = y * w_sorted[part, None]
        out.index_add_(0, tokens_sorted[part], y.to(x.dtype))
    return out


def fused_moe_gathered(form: ExpertFormat, banks: Banks, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_w: torch.Tensor, act: MoEActivation) -> torch.Tensor:
    """The reference's math for few pairs, the experts of all pairs in one batch: x [T, H] -> [T, H]
    in x.dtype, each token's outputs summed in ascending slot order as the reference does."""
    T, K = topk_ids.shape
    num_slots, hidden, _ = form.dims(banks)
    flat = topk_ids.reshape(-1).long()  # [P]
    check_slot_range(flat, num_slots)
    bias = form.has_bias(banks)
    xs = x.repeat_interleave(K, dim=0)  # [P, H]
    gate_up = _pair_matvecs(form, banks, "w13", flat, xs)  # [P, 2I]
    if bias:
        gate_up = gate_up + banks["w13_bias"][flat].to(x.dtype)
    h = apply_activation(gate_up, act)  # [P, I]
    y = _pair_matvecs(form, banks, "w2", flat, h)  # [P, H]
    if bias:
        y = y + banks["w2_bias"][flat].to(x.dtype)
    y = (y * topk_w.reshape(-1)[:, None]).to(x.dtype).view(T, K, hidden)
    return sum_in_slot_order(y, topk_ids)


def _pair_matvecs(form: ExpertFormat, banks: Banks, proj: str, flat: torch.Tensor, vecs: torch.Tensor) -> torch.Tensor:
    """Row p: W_proj[flat[p]] @ vecs[p]. flat: [P] slots, vecs: [P, in] -> [P, out] in vecs.dtype."""
    bank = banks.get(proj)
    if bank is not None and bank.dtype == vecs.dtype and bank[0].numel() * bank.element_size() >= IN_PLACE_MIN_BYTES:
        return torch.stack([torch.mv(bank[e], v) for e, v in zip(flat.tolist(), vecs)])
    w = form.dequant(banks, proj, flat, vecs.dtype)  # [P, out, in], transient
    return torch.bmm(w, vecs[:, :, None])[..., 0]
