"""The batched prefill path's fused bias + activation (layers/moe_act_triton.bias_act) against the
torch ops it replaces (moe_common.apply_activation after the bias add), under Triton's interpreter."""

from __future__ import annotations

import pytest

from triton_interp import run_interpreted

SCRIPT = r"""
import torch
from ferryman.layers.moe_act_triton import bias_act
from ferryman.layers.moe_common import MoEActivation, apply_activation

g = torch.Generator().manual_seed(0)
for kind, bias, inter in (("silu", False, 24), ("swiglu_oai", True, 40), ("silu", True, 1000)):
    act = MoEActivation(kind)
    gu = (torch.randn(3, 5, 2 * inter, generator=g) * 4).to(torch.bfloat16)  # |x| past swiglu's limit too
    b = (torch.randn(3, 2 * inter, generator=g)).to(torch.bfloat16) if bias else None
    ref = apply_activation((gu.float() + (b.float()[:, None, :] if bias else 0)), act)  # fp32, as the kernel
    got = bias_act(gu, b, kind, act.alpha, act.limit)
    assert got.shape == (3, 5, inter) and got.dtype == torch.bfloat16, (got.shape, got.dtype)
    torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=1e-3)  # one bf16 rounding of the fp32 value
    # against bf16 op-by-op (the CPU path): within bf16 rounding
    plain = apply_activation(gu + (b[:, None, :] if bias else 0), act)
    torch.testing.assert_close(got.float(), plain.float(), rtol=2e-2, atol=2e-2)
# a bank of biases read at the group's rows (fp32 here: rounded to gate_up's dtype first), as the
# same biases gathered and rounded: bit for bit (fp16: the interpreter truncates fp32 to bf16, where
# torch and CUDA round to nearest even)
gu = (torch.randn(3, 5, 48, generator=g) * 4).to(torch.float16)
bank = torch.randn(7, 48, generator=g)
rows = torch.tensor([5, 0, 3])
act = MoEActivation("swiglu_oai")
got = bias_act(gu, bank, "swiglu_oai", act.alpha, act.limit, rows)
assert torch.equal(got, bias_act(gu, bank[rows].to(torch.float16), "swiglu_oai", act.alpha, act.limit))
try:
    bias_act(gu, bank, "swiglu_oai", act.alpha, act.limit, rows[:2])
except ValueError as e:
    assert "rows (2,)" in str(e), e
else:
    raise AssertionError("rows of the wrong length accepted")
try:
    bias_act(torch.zeros(2, 3, 5), None, "silu", 1.0, 7.0)
except ValueError as e:
    assert "gate_up (2, 3, 5)" in str(e), e
else:
    raise AssertionError("odd 2I accepted")
print("ok")
"""


def test_bias_act_matches_the_torch_ops() -> None:
    assert run_interpreted(SCRIPT).strip().endswith("ok")
