"""The Triton top-k router equals the torch router (layers.moe.route), interpreted on CPU and on CUDA."""

from __future__ import annotations

import pytest

from triton_interp import run_interpreted

_CHECK = r"""
import torch
from ferryman.layers.moe import route
from ferryman.layers.router_triton import route_triton

def check(device):
    g = torch.Generator().manual_seed(0)
    cases = [("softmax_topk", True, 8, 128, torch.float32), ("softmax_topk", False, 8, 64, torch.bfloat16),
             ("softmax_topk", True, 2, 8, torch.float32), ("topk_softmax", False, 4, 32, torch.bfloat16),
             ("topk_softmax", False, 4, 128, torch.float32), ("softmax_topk", True, 3, 40, torch.float32)]
    for kind, renorm, k, e, dtype in cases:
        # distinct values: with ties the order of torch.topk is unspecified (ours: lower id first)
        logits = torch.stack([torch.randperm(e, generator=g) for _ in range(5)]).float() / 8 - e / 16
        logits = logits.to(device, dtype)
        want_i, want_w = route(logits.cpu(), k, kind, renorm)  # torch path (CPU tensors never take Triton)
        got_i, got_w = route_triton(logits, k, kind, renorm)
        assert torch.equal(got_i.cpu(), want_i.cpu()), (kind, k, e, got_i, want_i)
        assert got_w.dtype == want_w.dtype, (got_w.dtype, want_w.dtype)
        assert torch.allclose(got_w.float().cpu(), want_w.float().cpu(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                              atol=1e-6), (kind, got_w, want_w)
    print("ok")
"""


def test_router_interpreted() -> None:
    assert run_interpreted(_CHECK + "\ncheck('cpu')\n").strip().endswith("ok")


@pytest.mark.gpu
def test_router_cuda() -> None:
    ns: dict = {}
    exec(_CHECK, ns)
    ns["check"]("cuda")
