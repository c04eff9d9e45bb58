"""Where each bank of one expert sits in its row of bytes: the unit the host store keeps, the
GPU cache's slots hold and the link carries (experts/host_store.py, experts/gpu_cache.py). The
planner sizes slots with it; `allocate_rows` gives such rows host memory the link can read
asynchronously (the host store's, `ferryman bench bw`'s)."""

from __future__ import annotations

import logging
import mmap
import weakref
from dataclasses import dataclass

import torch

from ferryman.quant.base import BankSpec

log = logging.getLogger("ferryman.experts")

ALIGN = 64  # bytes; bank offsets and rows keep 16-byte vector loads and dtype views aligned


@dataclass(frozen=True)
class ExpertLayout:
    """Where each bank of one expert sits inside its row of bytes."""

    offsets: dict[str, int]  # bank name -> byte offset in the row
    sizes: dict[str, int]  # bank name -> bytes of one expert's slice
    shapes: dict[str, tuple[int, ...]]  # bank name -> per-expert shape (no leading E)
    dtypes: dict[str, torch.dtype]
    row_bytes: int  # bytes of one expert, padding included

    @staticmethod
    def of(specs: dict[str, BankSpec]) -> "ExpertLayout":
        offsets, sizes, shapes, dtypes, pos = {}, {}, {}, {}, 0
        for name, spec in specs.items():
            one = BankSpec(spec.shape[1:], spec.dtype)
            offsets[name], sizes[name] = pos, one.nbytes
            shapes[name], dtypes[name] = one.shape, spec.dtype
            pos += _align(one.nbytes)
        return ExpertLayout(offsets, sizes, shapes, dtypes, max(pos, ALIGN))

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Bank views `[N, ...]` of a flat `[N, row_bytes]` uint8 buffer (rows = experts or slots)."""
        if flat.dtype != torch.uint8 or flat.dim() != 2 or flat.shape[1] != self.row_bytes:
            raise ValueError(f"expert rows must be uint8 [N, {self.row_bytes}], got {tuple(flat.shape)} {flat.dtype}")
        n = flat.shape[0]
        out = {}
        for name, off in self.offsets.items():
            part = flat[:, off : off + self.sizes[name]]  # [N, bytes], row stride row_bytes
            out[name] = part.view(self.dtypes[name]).view(n, *self.shapes[name])
        return out


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def allocate_rows(rows: int, row_bytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
    """A `[rows, row_bytes]` uint8 host buffer, pinned if asked and possible -> (buffer, pinned).

    Pinned with cudaHostRegister on an ordinary allocation: torch's pinned allocator rounds every
    block up to a power of two (a 1.7 GB layer of gpt-oss-120b would lock 2 GB)."""
    if not pin:
        return torch.empty((rows, row_bytes), dtype=torch.uint8), False
    # cudaHostRegister locks whole pages and refuses a page already registered: a small buffer from
    # the heap may share its first or last page with another registered one (tiny models, the
    # bandwidth probe). So the buffer owns its pages: page-aligned, its span rounded up to pages.
    page = mmap.PAGESIZE
    nbytes = rows * row_bytes
    span = -(-nbytes // page) * page
    raw = torch.empty(span + page, dtype=torch.uint8)
    start = (-raw.data_ptr()) % page
    flat = raw[start : start + nbytes].view(rows, row_bytes)
    return flat, _register(flat, span)


def _register(flat: torch.Tensor, nbytes: int) -> bool:
    """Page-lock `nbytes` from `flat`'s start for the CUDA driver; unregistered when `flat` is freed."""
    try:
        cudart = torch.cuda.cudart()
        rc = int(cudart.cudaHostRegister(flat.data_ptr(), nbytes, 0))
    except (AssertionError, RuntimeError, AttributeError) as e:  # no CUDA runtime in this build
        log.debug("cannot pin host memory: %s", e)
        return False
    if rc != 0:  # quota (RLIMIT_MEMLOCK, WSL), out of lockable memory
        log.debug("cudaHostRegister of %d bytes failed with CUDA error %d", nbytes, rc)
        getattr(cudart, "cudaGetLastError", lambda: None)()  # do not leave the error for the next call
        return False
    weakref.finalize(flat, cudart.cudaHostUnregister, flat.data_ptr())
    return True
