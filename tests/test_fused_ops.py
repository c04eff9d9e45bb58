"""Fused RMSNorm / RoPE Triton kernels vs the torch paths (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from triton_interp import run_interpreted

_CHECK = r"""
import torch
from ferryman.config import RopeConfig
from ferryman.layers.norms import RMSNorm
from ferryman.layers.rotary import RotaryEmbedding
from ferryman.layers.fused_ops_triton import rms_norm_triton, rope_triton

def check(device, dtype, tol):
    g = torch.Generator().manual_seed(0)
    for H, fp32 in ((64, False), (80, True)):
        norm = RMSNorm(H, 1e-5, fp32).to(device)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=g))
        x = torch.randn(5, H, generator=g).to(device, dtype)
        r = torch.randn(5, H, generator=g).to(device, dtype)
        want = norm._torch(x)
        got, none = rms_norm_triton(x, norm.weight, 1e-5, None, fp32)
        assert none is None and (got.float() - want.float()).abs().max() <= tol, "rmsnorm"
        got, res = rms_norm_triton(x, norm.weight, 1e-5, r, fp32)
        assert torch.equal(res, x + r), "residual sum"
        assert (got.float() - norm._torch(x + r).float()).abs().max() <= tol, "fused rmsnorm"
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), 32, 64).to(device)
    rope.build(torch.device(device))
    qkv = torch.randn(7, (4 + 2 * 2) * 32, generator=g).to(device, dtype)
    q = qkv[:, :128].view(7, 4, 32)  # strided views, as the attention layer passes them
    k = qkv[:, 128:192].view(7, 2, 32)
    pos = torch.tensor([0, 1, 2, 9, 30, 31, 63], device=device)
    cos, sin = rope.cos[pos].to(dtype)[:, None], rope.sin[pos].to(dtype)[:, None]
    for x in (q, k):
        want = rope._rotate(x, cos, sin)
        got = rope_triton(x, pos, rope.cos, rope.sin)
        assert (got.float() - want.float()).abs().max() <= tol * 4, "rope"
    print("ok")
"""


def test_fused_ops_interpreted() -> None:
    out = run_interpreted(_CHECK + "\ncheck('cpu', torch.float32, 1e-5)\n")
    assert out.strip().endswith("ok")


@pytest.mark.gpu
def test_fused_ops_cuda() -> None:
    ns: dict = {}
    exec(_CHECK, ns)
    ns["check"]("cuda", torch.float32, 1e-5)
    ns["check"]("cuda", torch.bfloat16, 2e-2)
