"""The MoE activation and the gate/up row map in Triton, shared by the decode and grouped kernels."""

from __future__ import annotations

import triton
import triton.language as tl

ACT_KINDS = {"silu": 0, "swiglu_oai": 1}  # MoEActivation.kind -> the kernels' ACT constexpr


@triton.jit
def moe_act(gate, up, alpha, limit, ACT: tl.constexpr):
    # ACT 0 = silu: silu(gate) * up; 1 = swiglu_oai: clamped, (up + 1) * gate * sigmoid(alpha gate)
    if ACT == 0:
        h = gate * tl.sigmoid(gate) * up
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    return h


@triton.jit
def gate_up_rows(n, I: tl.constexpr, ACT: tl.constexpr):
    # rows of w13 holding gate / up column n of h. silu: n and I + n; swiglu_oai: 2n and 2n + 1
    if ACT == 0:
        return n, n + I
    return 2 * n, 2 * n + 1
