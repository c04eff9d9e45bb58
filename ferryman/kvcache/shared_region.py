"""One device region shared by the KV cache and the expert cache, carved into pages.

    page p = one expert slot (slot id p)  or  KV blocks p*q .. p*q + q-1  (q = blocks_per_page)

Layout: the region is `num_pages * q` KV blocks of `block_bytes` each (block b at byte b *
block_bytes); inside a block, the main-pool attention layers one after another (each layer's K
then V, or MLA's latent). So every layer's cache is a strided view `[N, S, Hkv, D]` whose block
stride is `block_bytes` (the paged-attention kernels take the block stride), and the expert slots
are a strided view `[num_pages, row_bytes]` whose row stride is `page_bytes = q * block_bytes`
(the MoE kernels read banks strided along the slot dim). Kernels are unchanged; moving a page
between the two uses copies nothing.

Invariant (kept by engine/memory_split.py): each page has exactly one owner. A page owned by the
expert cache has all q of its blocks withdrawn from the block pool; a page owned by the KV cache
is not an active slot of the slot table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# byte alignment of a KV block inside the region (and so of every page and slot row)
BLOCK_ALIGN = 256


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class PageGeometry:
    """Sizes of the shared region's pages; a pure function of the model's KV and expert sizes."""

    block_bytes: int  # one KV block of every main-pool layer, aligned to BLOCK_ALIGN
    blocks_per_page: int  # q: KV blocks in one page
    row_bytes: int  # one expert slot's bytes (<= page_bytes)

    @staticmethod
    def of(kv_block_bytes: int, row_bytes: int) -> PageGeometry:
        """Pages as small as one expert slot allows: the fewest whole KV blocks holding a slot."""
        block = _round_up(max(1, kv_block_bytes), BLOCK_ALIGN)
        return PageGeometry(block, max(1, -(-row_bytes // block)), row_bytes)

    @property
    def page_bytes(self) -> int:
        return self.block_bytes * self.blocks_per_page

    def pages_for_tokens(self, tokens: int, block_size: int) -> int:
        return -(-tokens // (block_size * self.blocks_per_page))


class SharedRegion:
    """The device buffer of `num_pages` pages and its two kinds of views."""

    def __init__(self, geometry: PageGeometry, num_pages: int, device: torch.device) -> None:
        if num_pages < 2:
            raise ValueError(f"the shared KV / expert region needs at least 2 pages, got {num_pages}")
        self.geometry, self.num_pages, self.device = geometry, num_pages, torch.device(device)
        # zeroed: a captured MoE graph may read a slot no copy has filled yet (padding rows)
        self.buffer = torch.zeros(num_pages * geometry.page_bytes, dtype=torch.uint8, device=self.device)
        self.next_offset = 0  # bytes of a block handed to layer views so far

    @property
    def num_blocks(self) -> int:
        return self.num_pages * self.geometry.blocks_per_page

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def slot_rows(self) -> torch.Tensor:
        """`[num_pages, row_bytes]` uint8, row p = page p's bytes (row stride page_bytes)."""
        g = self.geometry
        return self.buffer.as_strided((self.num_pages, g.row_bytes), (g.page_bytes, 1))

    def layer_view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next part of every block as one layer's cache `[num_blocks, *shape]` (shape: one
        block's, e.g. (S, Hkv, D)); successive calls take successive parts of the block."""
        item = torch.empty((), dtype=dtype).element_size()
        per_block = item * int(torch.Size(shape).numel())
        g = self.geometry
        if self.next_offset + per_block > g.block_bytes or self.next_offset % item:
            raise ValueError(f"a KV block of the shared region has {g.block_bytes} bytes; the layers ask for "
                             f"{self.next_offset + per_block} (at offset {self.next_offset})")
        typed = self.buffer.view(dtype)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        view = typed.as_strided((self.num_blocks, *shape), (g.block_bytes // item, *strides),
                                self.next_offset // item)
        self.next_offset += per_block
        return view
