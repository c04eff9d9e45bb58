"""Rotary position embeddings: default, linear and YaRN frequency schedules.

cos/sin are precomputed in fp32 for every position up to `max_positions` with the same arithmetic
as the reference (`positions * inv_freq` in fp32), then cast to the activation dtype at use.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ferryman.config import RopeConfig
from ferryman.layers.backend import use_triton


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, float(attention_factor)


def inv_freq_of(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot_dim/2], attention scaling) for a rope config."""
    dim = int(head_dim * rope.partial_rotary_factor)
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, dim)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        self.rot_dim = 2 * (int(head_dim * rope.partial_rotary_factor) // 2)
        half = self.rot_dim // 2
        self._pow2 = half & (half - 1) == 0 and head_dim & (head_dim - 1) == 0
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build(self.cos.device)  # on "meta" while the model is built shape-only

    def build(self, device: torch.device) -> None:
        """(Re)compute the cos/sin tables on `device`, always in fp32."""
        if device.type == "meta":  # a shape-only model: the tables stay empty
            return
        with torch.device("cpu"):
            inv_freq, scaling = inv_freq_of(self.rope, self.head_dim)
            positions = torch.arange(self.max_positions, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]  # [P, rot/2]
            cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        self.cos, self.sin = cos.to(device), sin.to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]
        if use_triton(q) and self._pow2:
            from ferryman.layers.fused_ops_triton import rope_triton

            return rope_triton(q, positions, self.cos, self.sin), rope_triton(k, positions, self.cos, self.sin)
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, rot/2]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rot_dim], x[..., self.rot_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        # rotate-half: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((out, rest), dim=-1) if rest.numel() else out
