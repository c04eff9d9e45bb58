"""Staged zero-copy decode (FERRYMAN_ZERO_COPY=1 with FERRYMAN_ZERO_COPY_STAGE=N): the uncached
experts of a decode layer are first copied into N staging rows on the device by one kernel, then the
decode kernel reads every expert from device memory.

Why: plain zero-copy (experts/row_addresses.py) lets the decode kernel read uncached experts over
the link directly. It needs no host sync per layer, so a whole decode step is one CUDA graph. But
the kernel's access pattern moved only 24 GB/s over the link, against 49.6 GB/s for a streaming
read kernel (docs/benchmarks.md, session 8). Staging keeps the sync-free step and moves the bytes
with a streaming read. Not measured on a GPU yet: `tools/gpu_suite.sh stageab`.

Per layer, all on the device and graph-capturable (`RowStager.stage`):
  staged[e] = addr[e] for every expert e of the layer      (a copy of the layer's address table)
  for each (token, k) pair p with expert e = ids[p] whose row is in host memory (outside the slot
  pool), and the first pair naming e:
      staging row p <- host row of e                        (_stage_rows_kernel, one launch)
      staged[e] = address of staging row p
Invariants:
- the staging rows and `staged` are reused by every layer: a layer's stage is issued on the compute
  stream after the previous layer's decode kernel, which is the last reader of both;
- pairs beyond the staging rows are never staged: such a step reads host rows directly (plain
  zero-copy), so a staged address always names a row this layer's stage wrote.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferryman.experts.row_addresses import RowAddressTable

CHUNK_WORDS = 16384  # 4-byte words one program copies (64 KiB)
BLOCK_WORDS = 1024  # words per load / store


@triton.jit
def _stage_rows_kernel(ids_ptr, addr_ptr, staged_ptr, buf_ptr, buf_addr, slot_lo, slot_hi, P,
                       ROW_WORDS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, P_PAD: tl.constexpr):
    # program (p, c): chunk c of pair p's expert row, if that row is in host memory and p is the
    # first pair naming the expert (a row is copied once per layer however many pairs use it)
    p = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    a = tl.load(addr_ptr + e)
    q = tl.arange(0, P_PAD)
    others = tl.load(ids_ptr + q, mask=q < P, other=-1).to(tl.int64)
    first = tl.min(tl.where(others == e, q, P_PAD))
    if ((a < slot_lo) | (a >= slot_hi)) & (first == p):
        src = a.to(tl.pointer_type(tl.int32))
        dst = buf_ptr + p.to(tl.int64) * ROW_WORDS
        for off in tl.static_range(0, CHUNK, BLOCK):
            w = c.to(tl.int64) * CHUNK + off + tl.arange(0, BLOCK)
            m = w < ROW_WORDS
            tl.store(dst + w, tl.load(src + w, mask=m), mask=m)
        if c == 0:
            tl.store(staged_ptr + e, buf_addr + p.to(tl.int64) * (ROW_WORDS * 4))


class RowStager:
    """`rows` staging rows on the table's device and the staged address table of one layer."""

    def __init__(self, table: RowAddressTable, slot_lo: int, slot_hi: int, rows: int) -> None:
        # slot_lo, slot_hi: the slot pool's byte range; an address outside it is a host row
        if rows < 1:
            raise ValueError(f"staged zero-copy needs at least 1 staging row, got {rows}")
        if table.row_bytes % 4:
            raise ValueError(f"staging copies 4-byte words; an expert row is {table.row_bytes} bytes")
        self.table, self.rows = table, rows
        self.slot_lo, self.slot_hi = slot_lo, slot_hi
        self.buf = torch.empty((rows, table.row_bytes // 4), dtype=torch.int32, device=table.device)
        self.staged = torch.empty(table.num_experts, dtype=torch.int64, device=table.device)  # [E]

    def fits(self, pairs: int) -> bool:
        return pairs <= self.rows

    def stage(self, index: int, ids: torch.Tensor) -> torch.Tensor:
        """The [E] addresses MoE layer `index` reads, its host-resident experts among `ids` ([T, K],
        T * K <= rows) copied into staging rows first. No host sync."""
        flat = ids.reshape(-1)  # [P]
        pairs = flat.numel()
        if not self.fits(pairs):
            raise ValueError(f"stage: {pairs} pairs but {self.rows} staging rows")
        self.staged.copy_(self.table.layer(index))
        words = self.table.row_bytes // 4
        grid = (pairs, triton.cdiv(words, CHUNK_WORDS))
        _stage_rows_kernel[grid](flat, self.table.layer(index), self.staged, self.buf, self.buf.data_ptr(),
                                 self.slot_lo, self.slot_hi, pairs, ROW_WORDS=words, CHUNK=CHUNK_WORDS,
                                 BLOCK=BLOCK_WORDS, P_PAD=max(16, triton.next_power_of_2(self.rows)))
        return self.staged
