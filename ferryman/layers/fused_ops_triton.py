"""Small fused Triton kernels for the decode hot path, where launches cost more than bytes:
(residual add +) RMSNorm, and RoPE, one launch each. Math in fp32, one rounding at the store."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, H, eps,
    HAS_RES: tl.constexpr, WEIGHT_FP32: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like a torch add
        tl.store(res_out_ptr + row * stride_o + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / H
    h = h * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if WEIGHT_FP32:
        y = (w.to(tl.float32) * h).to(x.dtype)
    else:
        y = (w.to(tl.float32) * h.to(x.dtype).to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                    weight_fp32: bool, into: tuple[torch.Tensor, torch.Tensor] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x, residual: [T, H] -> (norm(x + residual), x + residual) or (norm(x), None). into: the two
    outputs' tensors ([T, H] rows of one stride; each may be residual's or x's own rows: a row is
    read before it is written)."""
    T, H = x.shape
    if into is not None and residual is not None:
        out, res_out = into
        if out.stride() != res_out.stride() or out.stride(1) != 1:
            raise ValueError(f"rms_norm_triton: output strides {out.stride()} and {res_out.stride()} "
                             "must be equal, of unit column stride")
    else:
        out = torch.empty((T, H), dtype=x.dtype, device=x.device)
        res_out = torch.empty_like(out) if residual is not None else out
    res = residual if residual is not None else x
    _rms_norm_kernel[(T,)](
        x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0), H, eps,
        HAS_RES=residual is not None, WEIGHT_FP32=weight_fp32, BLOCK=triton.next_power_of_2(H),
    )
    return out, (res_out if residual is not None else None)


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ot, stride_oh,
    stride_c, NUM_HEADS: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BH, 1]
    cols = tl.arange(0, HALF)[None, :]  # [1, HALF]
    hmask = heads < NUM_HEADS
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * stride_c + cols)  # [1, HALF] fp32
    s = tl.load(sin_ptr + pos * stride_c + cols)
    base = x_ptr + t * stride_xt + heads * stride_xh
    x1 = tl.load(base + cols, mask=hmask, other=0.0)
    x2 = tl.load(base + HALF + cols, mask=hmask, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    obase = out_ptr + t * stride_ot + heads * stride_oh
    tl.store(obase + cols, (f1 * c - f2 * s).to(x1.dtype), mask=hmask)
    tl.store(obase + HALF + cols, (f2 * c + f1 * s).to(x1.dtype), mask=hmask)
    if D > 2 * HALF:  # partial rotary: copy the tail unchanged
        tail = tl.arange(0, D)[None, :]
        tmask = hmask & (tail >= 2 * HALF)
        tl.store(obase + tail, tl.load(base + tail, mask=tmask, other=0.0), mask=tmask)


def rope_triton(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (any strides) -> rotated copy [T, heads, D]; cos/sin: [P, rot/2] fp32."""
    T, heads, D = x.shape
    half = cos.shape[1]
    out = torch.empty((T, heads, D), dtype=x.dtype, device=x.device)
    _rope_kernel[(T,)](
        x, out, positions, cos, sin, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), NUM_HEADS=heads, HALF=half, D=D, BLOCK_H=triton.next_power_of_2(heads),
    )
    return out
