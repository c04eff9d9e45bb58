"""Can a kernel read experts straight from pinned host memory at link speed? (zero-copy, UVA)

    python benchmarks/bench_uva.py [--mib 1024] [--reps 5]

If a Triton kernel streaming page-locked host memory (cudaHostRegister'd, addressed through
unified virtual addressing) reaches about the copy engine's H2D rate, offloaded decode can read
its misses inside the MoE kernel: no host sync per layer, no copies on the critical path, the
whole step one CUDA graph. This measures, in one run:
- copy engine: `dst.copy_(pinned_src, non_blocking=True)` of the buffer (what a miss costs now);
- kernel from host: a Triton kernel reading the registered host buffer through its host address;
- kernel from device: the same kernel on a device copy (HBM), for scale;
- staged zero-copy's kernel (experts/staging.py) copying 4 gpt-oss-20b expert rows from pinned host
  memory into staging rows, against the copy engine moving the same rows.
Prints GB/s of each and the ratio kernel-from-host / copy engine. Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import cuda_seconds  # noqa: E402
from ferryman.experts.host_store import allocate_rows  # noqa: E402


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # each program XORs ITERS consecutive blocks of int32 words; the result keeps the loads alive
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


class HostPointer:
    """A registered host buffer handed to Triton by its address (UVA: the same on the device)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def read_with_kernel(src: object, n_words: int, out: torch.Tensor, block: int, iters: int) -> None:
    grid = (triton.cdiv(n_words, block * iters),)
    _read_kernel[grid](src, out, n_words, BLOCK=block, ITERS=iters, num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block", type=int, default=1024, help="int32 words per load step")
    ap.add_argument("--iters", type=int, default=16, help="load steps per program")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_uva needs a CUDA device")
    nbytes = a.mib << 20
    host, pinned = allocate_rows(1, nbytes, pin=True)
    if not pinned:
        raise SystemExit("cudaHostRegister failed: no pinned memory, nothing to measure")
    host.view(torch.int32).random_()
    words = nbytes // 4
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = torch.empty(triton.cdiv(words, a.block * a.iters) * a.block, dtype=torch.int32, device="cuda")
    src_host = HostPointer(host.view(-1).view(torch.int32))
    copy_s = cuda_seconds(lambda: dev.copy_(host.view(-1), non_blocking=True), a.reps)
    host_s = cuda_seconds(lambda: read_with_kernel(src_host, words, out, a.block, a.iters), a.reps)
    check = out.clone()
    dev_s = cuda_seconds(lambda: read_with_kernel(dev.view(torch.int32), words, out, a.block, a.iters), a.reps)
    same = torch.equal(check, out)  # the kernel read the same bytes from host and from device
    gb = nbytes / 1e9
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{a.mib} MiB, block {a.block} x {a.iters}")
    print(f"copy engine H2D (pinned):  {gb / copy_s:7.1f} GB/s")
    print(f"kernel reading host (UVA): {gb / host_s:7.1f} GB/s  (same result as from HBM: {same})")
    print(f"kernel reading HBM:        {gb / dev_s:7.1f} GB/s")
    print(f"kernel-from-host / copy engine = {copy_s / host_s:.2f}")
    stage_rows(a.reps)


def stage_rows(reps: int, rows: int = 4, row_bytes: int = 13236480) -> None:
    """Staged zero-copy's kernel (experts/staging.py) on `rows` gpt-oss-20b-sized expert rows in
    pinned host memory, against the copy engine moving the same rows one copy each."""
    from ferryman.experts.staging import RowStager

    class Table:  # what RowStager reads of a RowAddressTable: one layer of `rows` host experts
        def __init__(self, addr: torch.Tensor) -> None:
            self.addr, self.row_bytes, self.num_experts, self.device = addr, row_bytes, rows, addr.device

        def layer(self, index: int) -> torch.Tensor:
            return self.addr

    host, pinned = allocate_rows(rows, row_bytes, pin=True)
    host.view(torch.int32).random_()
    addr = (host.data_ptr() + torch.arange(rows, dtype=torch.int64) * row_bytes).cuda()
    slots = torch.empty((1, row_bytes), dtype=torch.uint8, device="cuda")  # no expert is cached
    stager = RowStager(Table(addr), slots.data_ptr(), slots.data_ptr() + slots.numel(), rows)  # type: ignore[arg-type]
    ids = torch.arange(rows, device="cuda")
    dst = torch.empty((rows, row_bytes), dtype=torch.uint8, device="cuda")
    stage_s = cuda_seconds(lambda: stager.stage(0, ids), reps)
    copy_s = cuda_seconds(lambda: [dst[r].copy_(host[r], non_blocking=True) for r in range(rows)], reps)
    same = torch.equal(stager.buf.view(torch.uint8).cpu(), host)
    gb = rows * row_bytes / 1e9
    print(f"staging kernel, {rows} expert rows of {row_bytes} bytes (pinned: {pinned}): {gb / stage_s:7.1f} GB/s "
          f"against {gb / copy_s:.1f} GB/s for {rows} copy-engine copies ({copy_s / stage_s:.2f}x); rows equal: {same}")


if __name__ == "__main__":
    main()
