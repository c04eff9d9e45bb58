"""NVFP4 expert formats (NVIDIA's modelopt releases, compressed-tensors `nvfp4-pack-quantized`).

Every row of K inputs is cut into K/16 groups of 16 e2m1 values (two per byte, element 2j in the
low nibble: the E2M1_VALUES codes of quant/mxfp4.py), each group with a float8 e4m3 scale, and each
weight tensor has one fp32 global scale g. The two layouts define g the opposite way round:

    nvfp4     (modelopt `weight_scale_2`):           w = code * (fp32(scale) * g)
    nvfp4-ct  (compressed-tensors `weight_global_scale`): w = code * (fp32(scale) / g)

so g is kept as the checkpoint stores it and each format applies its own operation (taking one for
the other gives weights off by g^2: confident nonsense). Products are fp32, rounded once to the
compute dtype. Gate and up keep their own global scales: w13_gscale [E, 2] (rows [0, I) use
column 0), w2_gscale [E, 1].
"""

from __future__ import annotations

import math

import torch

from ferryman.quant.base import Banks, BankSpec, ExpertFormat, check_proj, register_format, triton_available
from ferryman.quant.mxfp4 import E2M1_VALUES, e2m1_byte_pairs

GROUP = 16  # values per e4m3 scale
FP8 = torch.float8_e4m3fn
_E2M1_RMS = math.sqrt(sum(v * v for v in E2M1_VALUES) / 16)  # rms of a uniformly random code


def _check_k(k: int, what: str) -> None:
    if k % GROUP:
        raise ValueError(f"{what}: nvfp4 needs a multiple of {GROUP} inputs, got {k}")


def dequant_nvfp4(packed: torch.Tensor, scale: torch.Tensor, gscale: torch.Tensor, divide: bool,
                  dtype: torch.dtype) -> torch.Tensor:
    """packed [..., out, k/2] uint8 + scale [..., out, k/16] e4m3 + gscale [..., parts] fp32 (rows
    [p*out/parts, (p+1)*out/parts) use column p) -> [..., out, k] in `dtype`."""
    if packed.dtype != torch.uint8 or scale.dtype != FP8:
        raise ValueError(f"nvfp4 weights must be uint8 and scales float8_e4m3fn, got {packed.dtype}/{scale.dtype}")
    out, half = packed.shape[-2:]
    if tuple(scale.shape) != (*packed.shape[:-1], 2 * half // GROUP) or 2 * half % GROUP:
        raise ValueError(f"nvfp4 scales {tuple(scale.shape)} do not match packed weights {tuple(packed.shape)} "
                         f"(expected {(*packed.shape[:-1], 2 * half // GROUP)})")
    parts = gscale.shape[-1]
    if gscale.shape[:-1] != packed.shape[:-2] or parts < 1 or out % parts:
        raise ValueError(f"nvfp4 global scales {tuple(gscale.shape)} do not match packed weights {tuple(packed.shape)}")
    vals = e2m1_byte_pairs(packed.device)[packed.long()].flatten(-2)  # [..., out, k] fp32
    g = gscale.float().repeat_interleave(out // parts, dim=-1).unsqueeze(-1)  # [..., out, 1]
    eff = scale.float() / g if divide else scale.float() * g  # [..., out, k/16]
    return (vals.unflatten(-1, (-1, GROUP)) * eff.unsqueeze(-1)).flatten(-2).to(dtype)


def random_nvfp4(shape: tuple[int, ...], parts: int, divide: bool, generator: torch.Generator | None,
                 device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random valid nvfp4 weights of logical shape [..., out, k] -> (packed, scale, gscale [..., parts]):
    uniform codes, group scales 2^{-1,0,1}, global scales so the values have std ~ 1/sqrt(k)."""
    *lead, out, k = shape
    _check_k(k, "random_nvfp4")
    gen_device = generator.device if generator is not None else torch.device(device)
    packed = torch.randint(0, 256, (*lead, out, k // 2), generator=generator, dtype=torch.uint8, device=gen_device)
    jitter = torch.randint(-1, 2, (*lead, out, k // GROUP), generator=generator, device=gen_device).float()
    scale = torch.exp2(jitter).to(FP8)
    g = 1.0 / (_E2M1_RMS * 1.08 * math.sqrt(k))  # 1.08: rms of 2^{-1,0,1}
    gscale = torch.full((*lead, parts), 1.0 / g if divide else g, dtype=torch.float32, device=gen_device)
    return packed.to(device), scale.to(device), gscale.to(device)


class Nvfp4Format(ExpertFormat):
    """Banks: w13_packed [E, 2I, H/2], w2_packed [E, H, I/2] uint8; w13_scale [E, 2I, H/16],
    w2_scale [E, H, I/16] e4m3; w13_gscale [E, 2], w2_gscale [E, 1] fp32."""

    link_reads = False  # scales apart from the values, as mxfp4's: not measured reading host memory

    def __init__(self, name: str, divide: bool) -> None:
        self.name, self.divide = name, divide

    def weight_specs(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, BankSpec]:
        _check_k(hidden, f"{self.name} hidden size")
        _check_k(inter, f"{self.name} expert FFN size")
        e, u8, f32 = num_experts, torch.uint8, torch.float32
        return {
            "w13_packed": BankSpec((e, 2 * inter, hidden // 2), u8),
            "w13_scale": BankSpec((e, 2 * inter, hidden // GROUP), FP8),
            "w13_gscale": BankSpec((e, 2), f32),
            "w2_packed": BankSpec((e, hidden, inter // 2), u8),
            "w2_scale": BankSpec((e, hidden, inter // GROUP), FP8),
            "w2_gscale": BankSpec((e, 1), f32),
        }

    def dims(self, banks: Banks) -> tuple[int, int, int]:
        e, two_i, half = self.bank(banks, "w13_packed").shape
        return e, 2 * half, two_i // 2

    def random_weights(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                       generator: torch.Generator | None, device: torch.device | str) -> Banks:
        banks: Banks = {}
        for proj, out, k, parts in (("w13", 2 * inter, hidden, 2), ("w2", hidden, inter, 1)):
            p, s, g = random_nvfp4((num_experts, out, k), parts, self.divide, generator, device)
            banks[f"{proj}_packed"], banks[f"{proj}_scale"], banks[f"{proj}_gscale"] = p, s, g
        return banks

    def dequant(self, banks: Banks, proj: str, idx: torch.Tensor | slice,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        check_proj(proj)
        packed = self.bank(banks, f"{proj}_packed")  # [E, out, in/2]
        scale = self.bank(banks, f"{proj}_scale")  # [E, out, in/16]
        gscale = self.bank(banks, f"{proj}_gscale")  # [E, parts]
        dtype = dtype or self.model_dtype(banks)
        if packed.is_cuda and triton_available():  # the same values, read in place (quant/nvfp4_triton.py)
            from ferryman.quant.nvfp4_triton import dequant_nvfp4_rows

            rows = idx if isinstance(idx, slice) else idx.to(packed.device, non_blocking=True).reshape(-1)
            return dequant_nvfp4_rows(packed, scale, gscale, rows, self.divide, dtype)
        return dequant_nvfp4(packed[idx], scale[idx], gscale[idx], self.divide, dtype)  # [n, out, in]


NVFP4 = register_format(Nvfp4Format("nvfp4", divide=False))
NVFP4_CT = register_format(Nvfp4Format("nvfp4-ct", divide=True))
