"""Top-k routing in one Triton launch (CUDA decode path), the same math as `layers.moe.route`:
"softmax_topk" = fp32 softmax over all experts, top-k, optional renormalisation, fp32 weights;
"topk_softmax" (gpt-oss) = top-k on the raw logits, softmax over the k in fp32 rounded to the
logits' dtype. Ties go to the lower expert id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORM: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    emask = offs < E
    logits = tl.load(logits_ptr + t * E + offs, mask=emask, other=-float("inf")).to(tl.float32)
    if SOFTMAX_FIRST:
        e = tl.exp(logits - tl.max(logits, axis=0))
        scores = e / tl.sum(e, axis=0)
    else:
        scores = logits
    kk = tl.arange(0, BLOCK_K)
    top_v = tl.full([BLOCK_K], -float("inf"), tl.float32)
    top_i = tl.zeros([BLOCK_K], tl.int32)
    for k in tl.static_range(K):
        best = tl.max(scores, axis=0)
        idx = tl.min(tl.where(scores == best, offs, BLOCK_E), axis=0)  # lowest id among equals
        top_v = tl.where(kk == k, best, top_v)
        top_i = tl.where(kk == k, idx, top_i)
        scores = tl.where(offs == idx, -float("inf"), scores)
    kmask = kk < K
    if SOFTMAX_FIRST:
        w = top_v
        if RENORM:
            w = w / tl.sum(tl.where(kmask, w, 0.0), axis=0)
    else:
        e = tl.where(kmask, tl.exp(top_v - tl.max(top_v, axis=0)), 0.0)
        w = e / tl.sum(e, axis=0)
    tl.store(ids_ptr + t * K + kk, top_i.to(ids_ptr.dtype.element_ty), mask=kmask)
    tl.store(w_ptr + t * K + kk, w.to(w_ptr.dtype.element_ty), mask=kmask)


def route_triton(logits: torch.Tensor, top_k: int, kind: str, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (ids [T, K] int64, weights [T, K]) like `layers.moe.route`."""
    T, E = logits.shape
    logits = logits.contiguous()
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    softmax_first = kind == "softmax_topk"
    w = torch.empty(T, top_k, dtype=torch.float32 if softmax_first else logits.dtype, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, ids, w, E=E, K=top_k, BLOCK_E=triton.next_power_of_2(E),
                            BLOCK_K=triton.next_power_of_2(top_k), SOFTMAX_FIRST=softmax_first,
                            RENORM=renormalize, num_warps=1 if E <= 256 else 4)
    return ids, w
