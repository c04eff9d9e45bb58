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

On CUDA one call of the flash kernel covers a chunk: it reads grouped kv heads itself, and its causal
mask aligns the queries with the last keys (the chunk after every earlier key); the sinks then
rescale each row by its log-sum-exp.
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
    """CUDA's flash kernel: q [1, Hq, Q, D] over k, v [1, Hkv, L, D] (grouped heads: query head h reads
    kv head h // G) -> (out [1, Hq, Q, D], lse [1, Hq, Q] fp32). Causal aligns the queries with the
    last Q keys (the kernel's own convention: torch.nn.attention.bias.causal_lower_right calls it so)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse


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
    or fp16) -> [Q, Hq, D]: one causal call of `flash` (a test passes the CPU's), then the sinks:
    out * exp(lse - logaddexp(lse, sink)) = out * sigmoid(lse - sink)."""
    qh = q.transpose(0, 1)[None]  # [1, Hq, Q, D]
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, L, D]
    out, lse = flash(qh, kh, vh, True, scale)
    if sinks is not None:
        out = out.float() * torch.sigmoid(lse.float() - sinks.float()[None, :, None])[..., None]
    return out[0].transpose(0, 1).to(q.dtype)


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
