"""The batched prefill path's weighting and per-token sums in one kernel (layers/moe_act_triton.rank_sum)
against the torch ops it replaces (the w2 bias added, weights multiplied in place, index_copy_ to
each token's ranked rows, batched_moe.sum_ranked), for layouts built by the path's own helpers
(skewed routing, padding rows, K from 1 to 8): bit for bit on CUDA (gpu) and, under Triton's
interpreter, in fp16 and fp32. The interpreter truncates fp32 to bf16 where CUDA rounds to nearest
even, so its bf16 results are held to one bf16 step per rounding instead."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ferryman.layers.batched_moe import rank_sources
from triton_interp import run_interpreted

SCRIPT = r"""
import sys
import numpy as np
import torch
from ferryman.layers.batched_moe import padded_layout, rank_sources, row_experts, sum_ranked, summing_rows
from ferryman.layers.moe_act_triton import rank_sum
from ferryman.layers.moe_common import group_on_host

device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
g = torch.Generator().manual_seed(0)
cases = [(dtype, with_bias, shape) for dtype in (torch.bfloat16, torch.float16, torch.float32)
         for with_bias in (False, True) for shape in ((1, 1, 4, 8), (7, 2, 5, 24), (19, 4, 8, 40), (6, 8, 16, 33))]
for dtype, with_bias, (T, K, E, H) in cases:
    # [T, K], distinct per token; skewed: half the tokens take expert 0 first (padding rows elsewhere)
    zero = torch.zeros(1, dtype=torch.long)
    ids = torch.stack([torch.cat([zero, 1 + torch.randperm(E - 1, generator=g)[: K - 1]])
                       if t < T // 2 else torch.randperm(E, generator=g)[:K] for t in range(T)])
    w = torch.rand(T, K, generator=g) * 3
    slots, order, counts = group_on_host(ids.reshape(-1).numpy(), E)
    layout = padded_layout(slots, counts, 3)
    pair = order[layout.rows]
    rank = summing_rows(order, K)[layout.rows]
    P, R = T * K, len(pair)
    y = (torch.randn(R, H, generator=g) * 5).to(dtype)
    experts = torch.from_numpy(row_experts(layout.groups))  # [R] index into the used slots
    # a bank of biases: in y's dtype, or fp32 (every other case: rounded to y's dtype first)
    b2 = (torch.randn(len(layout.slots), H, generator=g) * 3).to(dtype if T % 2 else torch.float32)
    bias = (b2, experts) if with_bias else None
    # the torch ops: y += its expert's bias, y *= w (promoted, one rounding), index_copy_ to the
    # ranked rows, sum_ranked
    ref = y.clone()
    if with_bias:
        ref += b2[experts].to(dtype)
    ref.mul_(w.reshape(-1)[torch.from_numpy(pair)][:, None])
    dest = torch.from_numpy(np.where(layout.valid, rank, P))
    ranked = torch.empty((P + 1, H), dtype=dtype).index_copy_(0, dest, ref)[:P]
    want = sum_ranked(ranked.view(T, K, H))
    src = torch.from_numpy(rank_sources(rank, layout.valid, P))
    d = torch.device(device)
    if d.type == "cuda":  # the torch ops on the device too: their CUDA kernels round as the kernel does
        ref = y.to(d)
        if with_bias:
            ref += b2.to(d)[experts.to(d)].to(dtype)
        ref = ref.mul_(w.to(d).reshape(-1)[torch.from_numpy(pair).to(d)][:, None])
        ranked = torch.empty((P + 1, H), dtype=dtype, device=d).index_copy_(0, dest.to(d), ref)[:P]
        want = sum_ranked(ranked.view(T, K, H)).cpu()
    on = None if bias is None else (b2.to(d), experts.to(d))
    got = rank_sum(y.to(d), w.to(d), torch.from_numpy(pair).to(d), src.to(d), K, on).cpu()
    assert got.dtype == dtype and got.shape == (T, H), (got.dtype, got.shape)
    if dtype == torch.bfloat16 and d.type == "cpu":  # truncating: within one bf16 step per rounding
        step = 2 * K * 2**-7 * float(ref.float().abs().max())  # 2K roundings of at most one step of the terms' size
        torch.testing.assert_close(got.float(), want.float(), rtol=0.0, atol=step)
    else:
        assert torch.equal(got, want), (dtype, T, K, (got.float() - want.float()).abs().max())
try:
    idx = torch.zeros(4, dtype=torch.long)
    rank_sum(torch.zeros(4, 8), torch.zeros(2, 2), idx, idx[:3], 2)
except ValueError as e:
    assert "src (3,)" in str(e), e
else:
    raise AssertionError("a src of the wrong length was accepted")
print("ok")
"""


def test_rank_sum_equals_the_torch_ops_bit_for_bit() -> None:
    assert run_interpreted(SCRIPT).strip().endswith("ok")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rank_sum_on_cuda_equals_the_torch_ops_bit_for_bit() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, "cuda"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_rank_sources_inverts_the_output_rows_of_the_valid_rows() -> None:
    rank = np.array([2, 0, 0, 1, 3])  # padded rows 0..4; row 2 is padding (its rank is unused)
    valid = np.array([True, True, False, True, True])
    assert rank_sources(rank, valid, 4).tolist() == [1, 3, 0, 4]


FUSED_PATH = r"""
import torch
from ferryman.layers import backend
from ferryman.layers.batched_moe import fused_moe_batched
from ferryman.layers.moe_common import MoEActivation
from ferryman.quant import get_format

g = torch.Generator().manual_seed(3)
for fmt, kind, dtype in (("mxfp4", "swiglu_oai", torch.float16), ("dense", "silu", torch.float32),
                         ("dense", "swiglu_oai", torch.float16)):
    form = get_format(fmt)
    banks = form.random_banks(10, 64, 32, kind == "swiglu_oai", dtype, g)  # biases with swiglu_oai
    x = torch.randn(23, 64, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(10, generator=g)[:4] for _ in range(23)])
    w = torch.rand(23, 4, generator=g)
    act = MoEActivation(kind)
    backend.moe_fused_act = lambda x: False
    want = fused_moe_batched(form, banks, x, ids, w, act, group=3)
    backend.moe_fused_act = lambda x: True  # bias_act and rank_sum, under the interpreter, on the same layout
    got = fused_moe_batched(form, banks, x, ids, w, act, group=3)
    assert got.shape == want.shape and got.dtype == want.dtype
    # bias_act rounds act(gate + bias) once where the torch path rounds each op: within fp16's steps
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
print("ok")
"""


def test_the_fused_batched_path_equals_the_torch_path() -> None:
    """fused_moe_batched with the fused kernels (bias_act at the bank's rows, rank_sum with the w2 bias
    and each output row's padded row) against its torch path, on the same layouts: the plumbing."""
    assert run_interpreted(FUSED_PATH).strip().endswith("ok")
