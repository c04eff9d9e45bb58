"""`dense` expert format: banks hold the weights in the model dtype (bf16/fp16/fp32)."""

from __future__ import annotations

import torch

from ferryman.quant.base import Banks, BankSpec, ExpertFormat, check_proj, register_format


class DenseFormat(ExpertFormat):
    name = "dense"

    def weight_specs(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, BankSpec]:
        if not dtype.is_floating_point:
            raise ValueError(f"dense experts need a float dtype, got {dtype}")
        return {
            "w13": BankSpec((num_experts, 2 * inter, hidden), dtype),  # [E, 2I, H]
            "w2": BankSpec((num_experts, hidden, inter), dtype),  # [E, H, I]
        }

    def dims(self, banks: Banks) -> tuple[int, int, int]:
        e, two_i, h = self.bank(banks, "w13").shape
        return e, h, two_i // 2

    def model_dtype(self, banks: Banks) -> torch.dtype:
        return self.bank(banks, "w13").dtype

    def random_weights(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                       generator: torch.Generator | None, device: torch.device | str) -> Banks:
        gen_device = generator.device if generator is not None else torch.device(device)
        banks: Banks = {}
        for name, spec in self.weight_specs(num_experts, hidden, inter, dtype).items():
            w = torch.randn(spec.shape, generator=generator, device=gen_device)  # [E, out, in]
            banks[name] = (w / spec.shape[-1] ** 0.5).to(device, dtype)
        return banks

    def dequant(self, banks: Banks, proj: str, idx: torch.Tensor | slice,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        check_proj(proj)
        w = self.bank(banks, proj)[idx]  # [n, out, in]
        return w if dtype is None else w.to(dtype)


DENSE = register_format(DenseFormat())
