"""Attention of one sequence's prompt rows where the Triton kernel does not run (the CPU): torch's flash
attention (`paged_attention` calls it per sequence with the keys gathered from the blocks).

The torch reference (`paged_attention_reference`) materialises every score: a 1,500-token prompt of
the demo model spent 0.97 s of its 1.30 s profiled prefill there (docs/benchmarks.md, "CPU prefill
attention"). Here torch's fused flash
kernel attends, and returns the log-sum-exp of each query's scores, so that parts computed apart
merge exactly and gpt-oss's sinks join the softmax's denominator only:

    lse = log(sum_i exp(lse_i) + exp(sink)),  out = sum_i out_i * exp(lse_i - lse)

- full attention: the keys before the step's first query, all visible (no mask), and the step's
  own keys, a square causal block (so no question of how a causal mask aligns arises);
- a sliding window: blocks of WINDOW_BLOCK queries, each over the keys its window reaches, with
  an additive mask of that band.

Math in fp32 (q, k, v widened), the output in q's dtype, as the reference. Decode rows (one query of
a sequence) take the reference: its scores are one row.
"""

from __future__ import annotations

import torch
from torch import Tensor

WINDOW_BLOCK = 256  # queries per block of a sliding-window layer (its band mask: block x (block + window))
MIN_QUERIES = 2  # a sequence with fewer queries in the step (decode) keeps the reference


def available() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _flash(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
           mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q [1, Hq, Q, D], k, v [1, Hkv, L, D] fp32 -> (out [1, Hq, Q, D], lse [1, Hq, Q])."""
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                       scale=scale)
    return out[0], out[1]


def merge(parts: list[tuple[Tensor, Tensor]], sinks: Tensor | None) -> Tensor:
    """Parts (out [1, Hq, Q, D], lse [1, Hq, Q]) of one softmax over disjoint key sets, and the sinks'
    logits [Hq] in its denominator -> out [1, Hq, Q, D]. Invariant: every query sees a key in some
    part (its own position), so no lse is -inf."""
    if len(parts) == 1 and sinks is None:
        return parts[0][0]
    lse = parts[0][1]
    for _, part in parts[1:]:
        lse = torch.logaddexp(lse, part)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.float()[None, :, None].expand_as(lse))
    return sum(out * torch.exp(part - lse)[..., None] for out, part in parts)


def attend_sequence(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None,
                    sinks: Tensor | None) -> Tensor:
    """q [Q, Hq, D] at the last Q of the L positions of k, v [L, Hkv, D] -> [Q, Hq, D] in q.dtype."""
    n, length = q.shape[0], k.shape[0]
    first = length - n  # the first query's position
    qh = q.float().transpose(0, 1)[None]  # [1, Hq, Q, D]
    kh, vh = k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None]  # [1, Hkv, L, D]
    if window is None:
        parts = [_flash(qh, kh[:, :, first:], vh[:, :, first:], True, scale)]
        if first > 0:
            parts.append(_flash(qh, kh[:, :, :first], vh[:, :, :first], False, scale))
        out = merge(parts, sinks)
    else:
        outs = []
        for a in range(0, n, WINDOW_BLOCK):
            b = min(n, a + WINDOW_BLOCK)
            lo = max(0, first + a - window + 1)  # the first key the block's first query sees
            pos = torch.arange(first + a, first + b)[:, None]  # [B, 1]
            keys = torch.arange(lo, first + b)[None, :]  # [1, S]
            mask = torch.zeros(b - a, keys.shape[1]).masked_fill_((keys > pos) | (keys <= pos - window), float("-inf"))
            part = _flash(qh[:, :, a:b], kh[:, :, lo:first + b], vh[:, :, lo:first + b], False, scale, mask)
            outs.append(merge([part], sinks))
        out = torch.cat(outs, dim=2)
    return out[0].transpose(0, 1).to(q.dtype)
