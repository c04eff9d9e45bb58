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
        # into the rows it reads: the residual's own rows and the input's (a layer-major job's buffers)
        bufs = torch.cat([x, r]).view(2, 5, H).clone()
        got2, res2 = rms_norm_triton(bufs[0], norm.weight, 1e-5, bufs[1], fp32, into=(bufs[0], bufs[1]))
        assert got2.data_ptr() == bufs[0].data_ptr() and res2.data_ptr() == bufs[1].data_ptr(), "into"
        assert torch.equal(res2, res) and torch.equal(got2, got), "in place"
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


def test_add_forward_into_the_rows_it_reads_torch_path() -> None:
    """The torch path of RMSNorm.add_forward writes into given tensors that are the residual's own
    rows, or the input's, with the values it returns otherwise."""
    from ferryman.layers.norms import RMSNorm

    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(48, 1e-5, True)
    x, r = torch.randn(6, 48, generator=g).bfloat16(), torch.randn(6, 48, generator=g).bfloat16()
    want_out, want_res = norm.add_forward(x, r)
    res_rows, out = r.clone(), torch.empty_like(x)
    got_out, got_res = norm.add_forward(x, res_rows, into=(out, res_rows))  # the residual's rows
    assert got_out is out and got_res is res_rows
    assert torch.equal(out, want_out) and torch.equal(res_rows, want_res)
    x_rows, res_buf = x.clone(), torch.empty_like(r)
    got_out, _ = norm.add_forward(r, x_rows, into=(x_rows, res_buf))  # the input's rows, as residual
    want_out, want_res = norm.add_forward(r, x)
    assert torch.equal(x_rows, want_out) and torch.equal(res_buf, want_res)
