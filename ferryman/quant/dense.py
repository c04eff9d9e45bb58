"""`dense` expert format: banks hold the weights in the model dtype (bf16/fp16/fp32)."""

from __future__ import annotations

import torch

from ferryman.quant.base import (Banks, BankSpec, ExpertFormat, bias_specs, check_dims, check_proj, random_bias,
                                 register_format)


class DenseFormat(ExpertFormat):
    name = "dense"

    def bank_specs(self, num_experts: int, hidden: int, inter: int, bias: bool,
                   dtype: torch.dtype) -> dict[str, BankSpec]:
        check_dims(hidden, inter)
        if not dtype.is_floating_point:
            raise ValueError(f"dense experts need a float dtype, got {dtype}")
        specs = {
            "w13": BankSpec((num_experts, 2 * inter, hidden), dtype),  # [E, 2I, H]
            "w2": BankSpec((num_experts, hidden, inter), dtype),  # [E, H, I]
        }
        if bias:
            specs.update(bias_specs(num_experts, hidden, inter, dtype))
        return specs

    def dims(self, banks: Banks) -> tuple[int, int, int]:
        e, two_i, h = self.bank(banks, "w13").shape
        return e, h, two_i // 2

    def model_dtype(self, banks: Banks) -> torch.dtype:
        return self.bank(banks, "w13").dtype

    def random_banks(self, num_experts: int, hidden: int, inter: int, bias: bool, dtype: torch.dtype,
                     generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> Banks:
        gen_device = generator.device if generator is not None else torch.device(device)
        banks: Banks = {}
        for name, spec in self.bank_specs(num_experts, hidden, inter, False, dtype).items():
            w = torch.randn(spec.shape, generator=generator, device=gen_device)  # [E, out, in]
            banks[name] = (w / spec.shape[-1] ** 0.5).to(device, dtype)
        if bias:
            banks.update(random_bias(num_experts, hidden, inter, dtype, generator, device))
        return banks

    def dequant(self, banks: Banks, proj: str, idx: torch.Tensor | slice,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        check_proj(proj)
        w = self.bank(banks, proj)[idx]  # [n, out, in]
        return w if dtype is None else w.to(dtype)


DENSE = register_format(DenseFormat())
