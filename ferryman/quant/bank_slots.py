"""The slots of an expert bank that one in-place dequantiser launch reads (quant/*_triton.py).

A launch reads n slots and writes output rows 0..n-1: slots slot0 .. slot0 + n - 1 (a step-1 slice),
or idx[0..n-1] (a 1-D int tensor on the bank's device, read by the kernel: no host sync). Program
(p, r) of the grid works on output row r, its slot given by `program_slot`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def slot_span(idx: torch.Tensor | slice, num_slots: int, device: torch.device,
              what: str) -> tuple[int, int, torch.Tensor | None]:
    """(slots read, first slot, index tensor or None) for `idx` over a bank of `num_slots` slots;
    ValueError naming `what` for a slice whose step is not 1 or an idx that is not a 1-D int tensor
    on `device`."""
    if isinstance(idx, slice):
        start, stop, step = idx.indices(num_slots)
        if step != 1:
            raise ValueError(f"{what} rows: slice step must be 1, got {step}")
        return max(0, stop - start), start, None
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64) or idx.device != device:
        raise ValueError(f"{what} rows: idx must be a 1-D int tensor on {device}, got "
                         f"{tuple(idx.shape)} {idx.dtype} on {idx.device}")
    return idx.numel(), 0, idx.contiguous()


def rows_contiguous(t: torch.Tensor) -> bool:
    """Everything but dim 0 is one contiguous run (dim 0, the slots, may have any stride)."""
    return t[0].is_contiguous() if t.shape[0] else True


@triton.jit
def program_slot(idx_ptr, slot0, HAS_IDX: tl.constexpr):
    """(output row r, its bank slot) of this program: r = program_id(1), slot idx[r] (HAS_IDX) or slot0 + r."""
    r = tl.program_id(1)
    if HAS_IDX:
        slot = tl.load(idx_ptr + r).to(tl.int64)
    else:
        slot = slot0 + r.to(tl.int64)
    return r, slot
