"""`fp8:*` expert formats (DeepSeek-V3, Kimi-K2, Qwen3-FP8, GLM-4.5-FP8, MiniMax-M2, and
compressed-tensors FP8): float8 e4m3 weights times fp32 scales.

    fp8:<bn>x<bk>  a scale per [bn, bk] block:  w[r, c] = q[r, c] * s[r // bn, c // bk]
    fp8:channel    a scale per output row:      w[r, c] = q[r, c] * s[r]
                   (a per-tensor scale is written to every row of its tensor)

The product is taken in fp32 and rounded once to the compute dtype, as transformers' FP8
integration (`Fp8Dequantize`) and compressed-tensors' `_dequantize` do. Scale grids round up
(ceil(out / bn), ceil(k / bk)): the last block of a row or column may be partial. Gate and up share
the w13 bank, so a block format needs the expert FFN size to be a multiple of bn (every release's is).
"""

from __future__ import annotations

import math

import torch

from ferryman.quant.base import (Banks, BankSpec, ExpertFormat, check_proj, register_family, register_format,
                                 triton_available)

FP8 = torch.float8_e4m3fn
Block = tuple[int, int] | None  # (bn, bk) rows x inputs per scale; None: one scale per row


def scale_grid(out: int, k: int, block: Block) -> tuple[int, ...]:
    """Shape of the scales of one [out, k] weight."""
    if block is None:
        return (out,)
    return (-(-out // block[0]), -(-k // block[1]))


def expand_scales(s: torch.Tensor, out: int, k: int, block: Block) -> torch.Tensor:
    """scales [..., *grid] -> fp32 [..., out, k] (channel: [..., out, 1], broadcast by the caller)."""
    s = s.float()
    if block is None:
        return s.unsqueeze(-1)
    bn, bk = block
    return s.repeat_interleave(bn, dim=-2)[..., :out, :].repeat_interleave(bk, dim=-1)[..., :k]


def dequant_fp8(q: torch.Tensor, s: torch.Tensor, block: Block, dtype: torch.dtype) -> torch.Tensor:
    """q [..., out, k] float8_e4m3fn + scales [..., *scale_grid] -> [..., out, k] in `dtype`:
    fp32(q) * fp32(scale), rounded once."""
    if q.dtype != FP8:
        raise ValueError(f"fp8 weights must be float8_e4m3fn, got {q.dtype}")
    out, k = q.shape[-2:]
    grid = scale_grid(out, k, block)
    if tuple(s.shape[q.dim() - 2:]) != grid or s.shape[: q.dim() - 2] != q.shape[:-2]:
        raise ValueError(f"fp8 scales {tuple(s.shape)} do not match weights {tuple(q.shape)} "
                         f"(expected {(*q.shape[:-2], *grid)} for block {block})")
    return (q.float() * expand_scales(s, out, k, block)).to(dtype)


def random_fp8(shape: tuple[int, ...], block: Block, generator: torch.Generator | None,
               device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp8 weights of logical shape [..., out, k] -> (q, scales): values of std ~ 1/sqrt(k),
    codes spread over e4m3's range, scales with a jitter of 2^{-1,0,1}."""
    *lead, out, k = shape
    gen_device = generator.device if generator is not None else torch.device(device)
    q = (torch.randn(shape, generator=generator, device=gen_device) * 32.0).to(FP8)
    grid = scale_grid(out, k, block)
    jitter = torch.randint(-1, 2, (*lead, *grid), generator=generator, device=gen_device).float()
    s = torch.exp2(jitter) / (32.0 * math.sqrt(k))
    return q.to(device), s.to(device)


class Fp8Format(ExpertFormat):
    """Banks: w13 [E, 2I, H] and w2 [E, H, I] float8 e4m3, w13_scale / w2_scale fp32 scale grids."""

    def __init__(self, block: Block) -> None:
        self.block = block
        self.name = "fp8:channel" if block is None else f"fp8:{block[0]}x{block[1]}"

    def weight_specs(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, BankSpec]:
        if self.block is not None and inter % self.block[0]:
            raise ValueError(f"{self.name} experts need an FFN size that is a multiple of {self.block[0]} "
                             f"(gate and up share one scale grid), got {inter}")
        e = num_experts
        return {
            "w13": BankSpec((e, 2 * inter, hidden), FP8),  # [E, 2I, H]
            "w13_scale": BankSpec((e, *scale_grid(2 * inter, hidden, self.block)), torch.float32),
            "w2": BankSpec((e, hidden, inter), FP8),  # [E, H, I]
            "w2_scale": BankSpec((e, *scale_grid(hidden, inter, self.block)), torch.float32),
        }

    def dims(self, banks: Banks) -> tuple[int, int, int]:
        e, two_i, h = self.bank(banks, "w13").shape
        return e, h, two_i // 2

    def random_weights(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                       generator: torch.Generator | None, device: torch.device | str) -> Banks:
        self.weight_specs(num_experts, hidden, inter, dtype)  # checks the dims
        banks: Banks = {}
        for proj, out, k in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
            banks[proj], banks[f"{proj}_scale"] = random_fp8((num_experts, out, k), self.block, generator, device)
        return banks

    def dequant(self, banks: Banks, proj: str, idx: torch.Tensor | slice,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        check_proj(proj)
        q, s = self.bank(banks, proj), self.bank(banks, f"{proj}_scale")  # [E, out, in], [E, *grid]
        dtype = dtype or self.model_dtype(banks)
        if q.is_cuda and triton_available():  # the same values, read in place (quant/fp8_triton.py)
            from ferryman.quant.fp8_triton import dequant_fp8_rows

            rows = idx if isinstance(idx, slice) else idx.to(q.device, non_blocking=True).reshape(-1)
            return dequant_fp8_rows(q, s, rows, self.block, dtype)
        return dequant_fp8(q[idx], s[idx], self.block, dtype)  # [n, out, in]


def fp8_family(name: str) -> Fp8Format:
    """"fp8:channel" or "fp8:<bn>x<bk>" (e.g. fp8:128x128)."""
    param = name.split(":", 1)[1]
    if param == "channel":
        return Fp8Format(None)
    try:
        bn, bk = (int(v) for v in param.split("x"))
    except ValueError:
        raise ValueError(f"fp8 format {name!r}: expected fp8:channel or fp8:<rows>x<cols>, e.g. fp8:128x128") from None
    if bn <= 0 or bk <= 0:
        raise ValueError(f"fp8 format {name!r}: block dims must be positive")
    return Fp8Format((bn, bk))


register_family("fp8", fp8_family)
FP8_BLOCK_128 = register_format(fp8_family("fp8:128x128"))
