"""RMSNorm, computed in fp32 like the reference implementations."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = w * x / rms(x).

    `weight_fp32` selects where the weight is applied: gpt-oss multiplies in fp32 and casts the
    product, Llama-family models cast first and multiply in the input dtype. Both orders are kept so
    bf16 outputs match each model's reference bit for bit.
    """

    def __init__(self, size: int, eps: float, weight_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.weight_fp32 = weight_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., size]
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_fp32:
            return (self.weight.float() * h).to(dtype)
        return self.weight * h.to(dtype)
