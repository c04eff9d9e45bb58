"""Attention of one sequence's prompt rows through torch's flash attention, the keys gathered from the
blocks: on the CPU (where the Triton kernel does not run) for every prompt, on CUDA for one long
sequence's full-attention rows (a long prompt's chunk, `dense_cuda`), where the fused flash kernel
outruns the paged Triton kernel.

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

On the CPU the math is fp32 (q, k, v widened); on CUDA the kernel reads q's dtype (bf16 or fp16) and
the merge runs in fp32; the output has q's dtype, as the reference's. Decode rows (one query of a
sequence) take the reference on the CPU: its scores are one row.

CUDA's flash op wants as many kv heads as query heads: the keys before the chunk are read once for
the G query heads of a kv head by stacking those heads' rows ([Hkv, G x Q, D]: no mask there, so
rows may be stacked), and the chunk's own square causal block repeats its keys G times.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

WINDOW_BLOCK = 256  # queries per block of a sliding-window layer (its band mask: block x (block + window))
MIN_QUERIES = 2  # a sequence with fewer queries in the step (decode) keeps the reference
CUDA_MIN_QUERIES = 1024  # a CUDA step of one sequence with fewer prompt rows keeps the paged Triton kernel


def available() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _flash(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
           mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q [1, Hq, Q, D], k, v [1, Hkv, L, D] fp32 -> (out [1, Hq, Q, D], lse [1, Hq, Q])."""
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                       scale=scale)
    return out[0], out[1]


Flash = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]


def flash_cuda(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """CUDA's flash kernel: q, k, v [1, H, Q or L, D] (equal head counts) -> (out [1, H, Q, D], lse [1, H, Q])."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse


def _grouped(flash: Flash, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """q [1, Hq, Q, D] over k, v [1, Hkv, L, D] through a kernel that wants equal head counts."""
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return flash(q, k, v, causal, scale)
    if not causal:  # stack each kv head's G query heads as rows: k, v read once
        _, hq, n, d = q.shape
        qf = q.contiguous().reshape(1, k.shape[1], group * n, d)  # [1, Hkv, G x Q, D]
        out, lse = flash(qf, k, v, False, scale)
        return out.reshape(1, hq, n, d), lse.reshape(1, hq, n)
    return flash(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), True, scale)


def dense_cuda(q: Tensor, k_cache: Tensor, window: int | None, num_seqs: int, max_query_len: int) -> bool:
    """Whether `paged_attention` takes torch's flash kernel for a CUDA step: one sequence (its rows
    are the whole step), at least CUDA_MIN_QUERIES of them, full attention, a kv cache in q's dtype
    (bf16 or fp16) and a head size the kernel takes."""
    return (q.is_cuda and num_seqs == 1 and window is None and max_query_len >= CUDA_MIN_QUERIES
            and q.shape[0] == max_query_len and q.dtype in (torch.bfloat16, torch.float16)
            and k_cache.dtype == q.dtype and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


def attend_cuda(q: Tensor, k: Tensor, v: Tensor, scale: float, sinks: Tensor | None,
                flash: Flash = flash_cuda) -> Tensor:
    """Full attention of q [Q, Hq, D] at the last Q of the L positions of k, v [L, Hkv, D] (CUDA, bf16
    or fp16) -> [Q, Hq, D]: the chunk's square causal block and the keys before it, merged. `flash`:
    the kernel (a test passes the CPU's)."""
    n, length = q.shape[0], k.shape[0]
    first = length - n
    qh = q.transpose(0, 1)[None]  # [1, Hq, Q, D]
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, L, D]
    out, lse = _grouped(flash, qh, kh[:, :, first:], vh[:, :, first:], True, scale)
    parts = [(out.float(), lse.float())]
    if first > 0:
        out, lse = _grouped(flash, qh, kh[:, :, :first], vh[:, :, :first], False, scale)
        parts.append((out.float(), lse.float()))
    return merge(parts, sinks)[0].transpose(0, 1).to(q.dtype)


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
