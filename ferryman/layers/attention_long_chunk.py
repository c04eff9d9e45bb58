"""A long prompt chunk of one sequence on CUDA through cuDNN's fused attention (torch's SDPA op).

A layer-major prefill's chunks of a 16k-32k-token prompt spend most of their attention in the
full-attention layers' rows over all earlier keys; there cuDNN runs 1.13x (16k) to 1.25x (32k) the
paged Triton kernel (docs/benchmarks.md, "Long prompts"). It attends in two parts merged by their
log-sum-exp (paged_attention_torch.merge, which also adds gpt-oss's sinks to the denominator):

- the keys before the chunk, all visible: each kv head's G query heads stacked as rows of one
  head ([1, Hkv, G x Q, D]), so the earlier keys are read once and never repeated;
- the chunk's own keys, a square causal block (cuDNN aligns its causal mask top-left, right for a
  square block only), with k and v repeated per query head.

It applies to a step of one sequence with at least MIN_QUERIES rows, full attention, the cache in
q's dtype, and no rows past the sequence's (a CUDA graph's padding); anything else, or a cuDNN that
refuses the call (once: then never again in the process), takes the paged kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from ferryman.layers.attn_metadata import AttnMetadata
from ferryman.layers.paged_attention_torch import merge

MIN_QUERIES = 1024  # fewer rows: the paged kernel (the measured gain is for 4096-token chunks)

# (q [1, H, Q, D], k, v [1, H, L, D], causal, scale) -> (out [1, H, Q, D], lse [1, H, Q] fp32)
Attend = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]

_refused: list[str] = []  # the first error cuDNN raised in this process, if any
log = logging.getLogger(__name__)


def applies(q: Tensor, k_cache: Tensor, meta: AttnMetadata, window: int | None) -> bool:
    """Whether `attend_long_chunk` takes this step (host values only: no device read)."""
    return (window is None and not _refused and q.is_cuda and k_cache.dtype == q.dtype
            and meta.block_tables.shape[0] == 1 and meta.max_query_len >= MIN_QUERIES
            and q.shape[0] == meta.max_query_len and torch.backends.cudnn.is_available())


def cudnn_attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q.shape[:3])


def attend_long_chunk(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnMetadata, scale: float,
                      sinks: Tensor | None, attend: Attend = cudnn_attend) -> Tensor | None:
    """q [Q, Hq, D], the sequence's last Q positions of max_seq_len, over its cached keys -> [Q, Hq, D]
    in q.dtype; None when cuDNN refused the call (the caller takes the paged kernel)."""
    n, length = q.shape[0], meta.max_seq_len
    first = length - n  # the chunk's first position
    hq, d, hkv, block = q.shape[1], q.shape[2], k_cache.shape[2], k_cache.shape[1]
    group = hq // hkv
    blocks = meta.block_tables[0, : -(-length // block)].long()
    k = k_cache[blocks].flatten(0, 1)[:length].transpose(0, 1)[None]  # [1, Hkv, L, D]
    v = v_cache[blocks].flatten(0, 1)[:length].transpose(0, 1)[None]
    qh = q.transpose(0, 1).contiguous()[None]  # [1, Hq, Q, D]; head h reads kv head h // G
    try:
        own = k[:, :, first:].repeat_interleave(group, 1), v[:, :, first:].repeat_interleave(group, 1)
        parts = [attend(qh, *own, True, scale)]
        if first > 0:
            stacked = qh.view(1, hkv, group * n, d)  # each kv head's G query heads as rows
            out, lse = attend(stacked, k[:, :, :first].contiguous(), v[:, :, :first].contiguous(), False, scale)
            parts.append((out.reshape(1, hq, n, d), lse.reshape(1, hq, n)))
    except RuntimeError as e:  # this cuDNN cannot run it: the paged kernel from now on
        _refused.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
        log.warning("cuDNN attention refused a long prompt chunk (%s); the paged kernel runs them", _refused[0])
        return None
    out = merge([(o.float(), lse.float()) for o, lse in parts], sinks)  # [1, Hq, Q, D] fp32
    return out[0].transpose(0, 1).to(q.dtype)
