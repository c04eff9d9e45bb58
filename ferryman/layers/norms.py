"""RMSNorm, computed in fp32 like the reference implementations, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ferryman.layers.backend import use_triton


class RMSNorm(nn.Module):
    """y = w * x / rms(x). weight_fp32: multiply in fp32 and cast the product (gpt-oss), else cast
    first and multiply in the input dtype (Llama family): each model's reference, bit for bit.
    unit_offset: the stored weight is w - 1 (Qwen3-Next, Qwen3.5), multiplied as 1 + w in fp32."""

    def __init__(self, size: int, eps: float, weight_fp32: bool = False, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.weight_fp32 = weight_fp32 or unit_offset
        self.unit_offset = unit_offset

    def scale(self) -> torch.Tensor:
        """The weight the normalised x is multiplied by."""
        return self.weight.float() + 1.0 if self.unit_offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., size]
        if x.dim() == 2 and use_triton(x):
            from ferryman.layers.fused_ops_triton import rms_norm_triton

            return rms_norm_triton(x, self.scale(), self.eps, None, self.weight_fp32)[0]
        return self._torch(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor,
                    into: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); x, residual: [T, size]. into: tensors [T, size] to write
        the two into (returned), which may be residual's or x's own rows."""
        if use_triton(x):
            from ferryman.layers.fused_ops_triton import rms_norm_triton

            return rms_norm_triton(x, self.scale(), self.eps, residual, self.weight_fp32, into)  # type: ignore
        if into is None:
            h = x + residual
            return self._torch(h), h
        out, h = into
        torch.add(x, residual, out=h)
        out.copy_(self._torch(h))
        return out, h

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_fp32:
            return (self.scale().float() * h).to(dtype)
        return self.weight * h.to(dtype)


class GatedRMSNorm(nn.Module):
    """The gated DeltaNet's output norm: w * x / rms(x) * silu(z), per head (x, z: [..., size])."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(z.float())).to(dtype)
