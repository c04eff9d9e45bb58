"""`mxfp4` expert format (gpt-oss checkpoints, OCP microscaling FP4).

Every row of K inputs is cut into K/32 blocks of 32 values. A block is 16 bytes of e2m1 codes
plus one e8m0 scale byte s meaning 2^(s - 127). Byte j of a block holds element 2j in its low
nibble and element 2j+1 in its high nibble. Codes index E2M1_VALUES (bit 3 is the sign).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from ferryman.quant.base import Banks, BankSpec, ExpertFormat, check_proj, register_format, triton_available

BLOCK = 32  # values per scale
BLOCK_BYTES = BLOCK // 2
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Rounding boundaries between consecutive e2m1 magnitudes (codes 0..7).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_EMAX_ELEM = 2  # 6.0 = 1.5 * 2^2: the largest e2m1 power of two
_E2M1_RMS = math.sqrt(sum(v * v for v in E2M1_VALUES) / 16)  # rms of a uniformly random code


@lru_cache(maxsize=8)
def e2m1_byte_pairs(device: torch.device) -> torch.Tensor:
    """fp32 (low nibble, high nibble) values of each byte [256, 2] on `device`."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)  # [16] value of each code
    return torch.stack((lut.repeat(16), lut.repeat_interleave(16)), dim=-1)


def _check_k(k: int, what: str) -> None:
    if k % BLOCK:
        raise ValueError(f"{what}: the input dim must be a multiple of {BLOCK}, got {k}")


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8 + scales [..., G] uint8 -> [..., G*32] in `dtype`: code x 2^(s-127)
    in fp32, exact (or inf) as transformers' ldexp, then rounded once to `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[-1] != BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks = scales.shape + ({BLOCK_BYTES},))")
    vals = e2m1_byte_pairs(blocks.device)[blocks.long()].flatten(-2)  # [..., G, 32] codes of 2j, 2j+1
    # x 2^(s-127) as multiplies by finite powers of two, exact like ldexp: s = 255 (2^128 is not a
    # finite fp32) is 2^127 then x 2, so 0 stays 0 and only values that overflow become inf
    exp = scales.to(torch.float32).clamp(max=254.0) - 127.0
    vals.mul_(torch.exp2(exp).unsqueeze(-1))
    top = scales == 255
    if bool(top.any()):
        vals[top] *= 2.0
    return vals.to(dtype).flatten(-2)  # [..., G*32]


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code of each fp32 value (ties to the smaller magnitude, zero has no sign)."""
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=q.device)
    mag = torch.bucketize(q.abs(), mids, right=False)  # 0..7, |q| > 6 saturates to 6
    sign = ((q < 0) & (mag > 0)).to(torch.int64) << 3
    return (mag | sign).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K % 32 == 0) -> (blocks [..., K/32, 16], scales [..., K/32]) uint8. OCP MX rule
    (as ggml): per block s = floor(log2(amax)) - 2 + 127, so amax / 2^(s-127) lies in [4, 8); values
    round to the nearest e2m1 and saturate at +-6."""
    _check_k(w.shape[-1], "quantize_mxfp4")
    w32 = w.detach().float().unflatten(-1, (-1, BLOCK))  # [..., G, 32]
    amax = w32.abs().amax(dim=-1)  # [..., G]
    exp = torch.floor(torch.log2(amax)) - _EMAX_ELEM + 127
    scales = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(0, 254).to(torch.uint8)
    codes = e2m1_codes(torch.ldexp(w32, (127 - scales.to(torch.int32)).unsqueeze(-1)))  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    return blocks.contiguous(), scales


def random_mxfp4(shape: tuple[int, ...] | torch.Size, generator: torch.Generator | None = None,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random valid mxfp4 weights of logical `shape` [..., K] -> (blocks, scales): uniform codes,
    scales 127 - log2(rms(code) * sqrt(K) * jitter) with a jitter of 2^{-1,0,1}, so the values have
    a std of about 1/sqrt(K) and activations stay finite."""
    *lead, k = shape
    _check_k(k, "random_mxfp4")
    g = k // BLOCK
    gen_device = generator.device if generator is not None else torch.device(device)
    blocks = torch.randint(0, 256, (*lead, g, BLOCK_BYTES), generator=generator, dtype=torch.uint8,
                           device=gen_device)
    jitter_rms = math.sqrt((0.25 + 1.0 + 4.0) / 3)  # rms of 2^j, j uniform in {-1, 0, 1}
    base = 127 - round(math.log2(_E2M1_RMS * jitter_rms * math.sqrt(k)))
    jitter = torch.randint(-1, 2, (*lead, g), generator=generator, device=gen_device)
    scales = (base + jitter).clamp(1, 254).to(torch.uint8)
    return blocks.to(device), scales.to(device)


class Mxfp4Format(ExpertFormat):
    name = "mxfp4"
    link_reads = False  # read from host memory at about half the copy rate (26 against 50 GB/s)

    def weight_specs(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, BankSpec]:
        _check_k(hidden, "mxfp4 hidden size")
        _check_k(inter, "mxfp4 expert FFN size")
        e, u8 = num_experts, torch.uint8
        return {
            "w13_blocks": BankSpec((e, 2 * inter, hidden // BLOCK, BLOCK_BYTES), u8),
            "w13_scales": BankSpec((e, 2 * inter, hidden // BLOCK), u8),
            "w2_blocks": BankSpec((e, hidden, inter // BLOCK, BLOCK_BYTES), u8),
            "w2_scales": BankSpec((e, hidden, inter // BLOCK), u8),
        }

    def dims(self, banks: Banks) -> tuple[int, int, int]:
        e, two_i, g, _ = self.bank(banks, "w13_blocks").shape
        return e, g * BLOCK, two_i // 2

    def random_weights(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                       generator: torch.Generator | None, device: torch.device | str) -> Banks:
        banks: Banks = {}
        for proj, out, k in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
            banks[f"{proj}_blocks"], banks[f"{proj}_scales"] = random_mxfp4((num_experts, out, k), generator, device)
        return banks

    def dequant(self, banks: Banks, proj: str, idx: torch.Tensor | slice,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        check_proj(proj)
        blocks = self.bank(banks, f"{proj}_blocks")  # [E, out, in/32, 16]
        scales = self.bank(banks, f"{proj}_scales")  # [E, out, in/32]
        dtype = dtype or self.model_dtype(banks)
        if blocks.is_cuda and triton_available():  # the same values in one launch, read in place (quant/mxfp4_triton.py)
            from ferryman.quant.mxfp4_triton import dequant_mxfp4_rows, dequant_mxfp4_triton

            if isinstance(idx, slice) or idx.dim() == 1:
                rows = idx if isinstance(idx, slice) else idx.to(blocks.device, non_blocking=True)
                return dequant_mxfp4_rows(blocks, scales, rows, dtype)  # [n, out, in]
            return dequant_mxfp4_triton(blocks[idx], scales[idx], dtype)
        return dequant_mxfp4(blocks[idx], scales[idx], dtype)  # [n, out, in]


MXFP4 = register_format(Mxfp4Format())
