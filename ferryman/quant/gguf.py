"""`gguf:<w13_type>:<w2_type>` expert formats: routed experts kept in their GGUF (ggml) blocks.

Each output row of a projection is its GGUF blocks along the input dim, exactly as the file holds
it, so an expert moves from disk to host RAM, a GPU slot and the link at its file size:
    w13_q  uint8 [E, 2I, row_bytes(w13_type, H)]   gate rows then up rows (silu models), as w13
    w2_q   uint8 [E, H, row_bytes(w2_type, I)]
plus the optional model-dtype biases of every format. Type names are ggml's, lower case
(quant/gguf_blocks.py); gate and up share one type, as in the mixes llama.cpp writes.
"""

from __future__ import annotations

import torch

from ferryman.quant.base import (Banks, BankSpec, ExpertFormat, check_proj, register_family,
                                 triton_available)
from ferryman.quant.gguf_blocks import GGUF_TYPES, block_size, check_type, dequant_rows, random_rows, row_bytes

FAMILY = "gguf"


def format_name(w13_type: str, w2_type: str) -> str:
    return f"{FAMILY}:{check_type(w13_type)}:{check_type(w2_type)}"


class GgufFormat(ExpertFormat):
    """Experts whose gate/up rows are `w13_type` blocks and down rows `w2_type` blocks."""

    def __init__(self, w13_type: str, w2_type: str) -> None:
        self.types = {"w13": check_type(w13_type), "w2": check_type(w2_type)}
        self.name = format_name(w13_type, w2_type)
        self.link_reads = "mxfp4" not in self.types.values()  # not measured reading host memory: copied

    def _row_bytes(self, proj: str, k: int, dim: str) -> int:
        gtype = self.types[proj]
        if k <= 0 or k % block_size(gtype):
            raise ValueError(f"{self.name}: {dim} {k} is not a multiple of the {gtype} block size "
                             f"{block_size(gtype)}")
        return row_bytes(gtype, k)

    def weight_specs(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, BankSpec]:
        e, u8 = num_experts, torch.uint8
        return {
            "w13_q": BankSpec((e, 2 * inter, self._row_bytes("w13", hidden, "hidden size")), u8),
            "w2_q": BankSpec((e, hidden, self._row_bytes("w2", inter, "expert FFN size")), u8),
        }

    def dims(self, banks: Banks) -> tuple[int, int, int]:
        e, two_i, _ = self.bank(banks, "w13_q").shape
        hidden = self.bank(banks, "w2_q").shape[1]
        return e, hidden, two_i // 2

    def random_weights(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                       generator: torch.Generator | None, device: torch.device | str) -> Banks:
        return {
            "w13_q": random_rows(self.types["w13"], (num_experts, 2 * inter, hidden), generator, device),
            "w2_q": random_rows(self.types["w2"], (num_experts, hidden, inter), generator, device),
        }

    def dequant(self, banks: Banks, proj: str, idx: torch.Tensor | slice,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        check_proj(proj)
        q = self.bank(banks, f"{proj}_q")  # [E, out, row_bytes]
        dtype = dtype or self.model_dtype(banks)
        if q.is_cuda and triton_available():  # the same values in one launch, read in place
            from ferryman.quant.gguf_triton import dequant_gguf_rows

            if isinstance(idx, slice) and idx.step not in (None, 1):
                idx = torch.arange(q.shape[0], device=q.device)[idx]
            rows = idx if isinstance(idx, slice) else idx.to(q.device, non_blocking=True)
            return dequant_gguf_rows(q, self.types[proj], rows, dtype)  # [n, out, in]
        return dequant_rows(q[idx], self.types[proj]).to(dtype)  # [n, out, in]


def gguf_format(w13_type: str, w2_type: str) -> ExpertFormat:
    """The registered format of experts with these GGUF types (ValueError naming a bad type)."""
    from ferryman.quant.base import get_format

    return get_format(format_name(w13_type, w2_type))


def _family(name: str) -> ExpertFormat:
    parts = name.split(":")
    if len(parts) != 3:
        raise ValueError(f"GGUF expert formats are named 'gguf:<w13_type>:<w2_type>' with types from "
                         f"{', '.join(GGUF_TYPES)}; got {name!r}")
    return GgufFormat(parts[1], parts[2])


register_family(FAMILY, _family)
