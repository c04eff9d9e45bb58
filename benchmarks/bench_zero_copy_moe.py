"""One offloaded MoE layer at decode: read the missing experts in the kernel (zero-copy) or copy
them into cache slots first (what the engine does now)?

    python benchmarks/bench_zero_copy_moe.py [--model gpt-oss-20b] [--tokens 1]

One MoE layer of the model's real shapes (dummy weights), `--tokens` decode tokens, top-k experts
each, cycled over disjoint expert sets so no run reuses the previous run's experts:
- resident: every expert in device memory (the resident decode kernel; the floor);
- zero-copy: the experts stay in pinned host memory; the same kernel reads their rows through
  an address table (RowAddresses) over the link;
- copy + compute: the experts are copied into device slots (copy engine, one copy per expert),
  then the kernel runs on the slots, after the copies (one stream).
Prints microseconds per layer call, the expert bytes each call moves, the GB/s that makes, and
copy+compute / zero-copy. Needs CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import cuda_seconds  # noqa: E402
from ferryman.config import ModelConfig  # noqa: E402
from ferryman.experts.host_store import ExpertLayout, allocate_rows  # noqa: E402
from ferryman.layers.fused_moe import MoEActivation  # noqa: E402
from ferryman.layers.fused_moe_triton import RowAddresses, fused_moe_decode  # noqa: E402
from ferryman.quant import get_format  # noqa: E402
from ferryman.weights.presets import get_preset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-oss-20b")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--reps", type=int, default=40)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_zero_copy_moe needs a CUDA device")
    cfg = ModelConfig.from_hf(get_preset(a.model))
    dtype, dev = cfg.dtype, torch.device("cuda")
    form = get_format(cfg.expert_format)
    e, h, i, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k
    layout = ExpertLayout.of(form.bank_specs(e, h, i, cfg.expert_bias, dtype))
    banks = form.random_banks(e, h, i, cfg.expert_bias, dtype, torch.Generator(device=dev).manual_seed(0), dev)
    resident_flat = torch.empty(e, layout.row_bytes, dtype=torch.uint8, device=dev)  # [E, row_bytes]
    resident = layout.views(resident_flat)
    for name, bank in banks.items():
        resident[name].copy_(bank)
    host, pinned = allocate_rows(e, layout.row_bytes, pin=True)
    if not pinned:
        raise SystemExit("cudaHostRegister failed: no pinned memory, nothing to measure")
    host.copy_(resident_flat.cpu())
    pairs = a.tokens * k
    sets = max(1, e // pairs)
    ids = [torch.arange(s * pairs, (s + 1) * pairs, device=dev, dtype=torch.int32).view(a.tokens, k) % e
           for s in range(sets)]
    x = torch.randn(a.tokens, h, device=dev).to(dtype)
    w = torch.softmax(torch.randn(a.tokens, k, device=dev), -1)
    act = MoEActivation(cfg.expert_act, cfg.swiglu_alpha, cfg.swiglu_limit)
    host_rows = RowAddresses(torch.tensor([host.data_ptr() + r * layout.row_bytes for r in range(e)],
                                          dtype=torch.int64, device=dev), layout.offsets)
    slots_flat = torch.empty(pairs, layout.row_bytes, dtype=torch.uint8, device=dev)
    slots = layout.views(slots_flat)
    slot_ids = torch.arange(pairs, device=dev, dtype=torch.int32).view(a.tokens, k)
    step = itertools.count()

    def run(mode: str) -> torch.Tensor:
        sel = ids[next(step) % sets]
        if mode == "resident":
            return fused_moe_decode(form.name, resident, x, sel, w, act.kind, act.alpha, act.limit)
        if mode == "zero-copy":
            return fused_moe_decode(form.name, slots, x, sel, w, act.kind, act.alpha, act.limit, rows=host_rows)
        for p, ex in enumerate(sel.reshape(-1).tolist()):  # ids are known on the host in the engine too
            slots_flat[p].copy_(host[ex], non_blocking=True)
        return fused_moe_decode(form.name, slots, x, slot_ids, w, act.kind, act.alpha, act.limit)

    ref = fused_moe_decode(form.name, resident, x, ids[0], w, act.kind, act.alpha, act.limit)
    zc = fused_moe_decode(form.name, slots, x, ids[0], w, act.kind, act.alpha, act.limit, rows=host_rows)
    same = torch.equal(ref, zc)
    moved = pairs * layout.row_bytes
    print(f"device: {torch.cuda.get_device_name()}, {a.model} layer: {e} experts x {layout.row_bytes / 2**20:.2f} MiB, "
          f"{a.tokens} token(s) x top-{k} = {pairs} experts per call; zero-copy equals resident: {same}")
    times = {m: cuda_seconds(lambda m=m: run(m), a.reps) for m in ("resident", "zero-copy", "copy+compute")}
    for m, t in times.items():
        rate = "" if m == "resident" else f"  {moved / t / 1e9:6.1f} GB/s of experts"
        print(f"{m:>13}: {t * 1e6:8.1f} us per layer call{rate}")
    print(f"copy+compute / zero-copy = {times['copy+compute'] / times['zero-copy']:.2f}")


if __name__ == "__main__":
    main()
