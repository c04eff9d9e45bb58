"""How fast does prefill dequantise an mxfp4 expert? Against the device's own copy bandwidth.

    python benchmarks/bench_dequant.py [--experts 4] [--reps 20]

Prefill MoE on CUDA dequantises every expert it runs (w13 and w2, gpt-oss shapes: 2880 x 5760
and 2880 x 2880) to bf16 before the GEMMs. The kernel is memory-bound: it reads 17/32 byte per
value and writes 2. This prints, in one run, for `--experts` slots of an expert-major pool (rows
read in place, by an index tensor):
- dequant: seconds per expert and GB/s moved (bytes read + written);
- copy: a device-to-device copy of the same output bytes (GB/s read + written), the baseline;
- the ratio dequant GB/s / copy GB/s (1.0 = as fast as the memory allows).
Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import cuda_seconds  # noqa: E402
from ferryman.quant.layout import ExpertLayout  # noqa: E402
from ferryman.quant import get_format  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=4, help="experts dequantised per call")
    ap.add_argument("--slots", type=int, default=16, help="slots in the pool the experts are read from")
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--inter", type=int, default=2880)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_dequant needs CUDA")
    fmt = get_format("mxfp4")
    layout = ExpertLayout.of(fmt.bank_specs(a.slots, a.hidden, a.inter, True, torch.bfloat16))
    flat = torch.randint(0, 256, (a.slots, layout.row_bytes), dtype=torch.uint8, device="cuda")
    banks = layout.views(flat)
    for proj in ("w13", "w2"):
        banks[f"{proj}_scales"].clamp_(100, 140)
    idx = torch.randperm(a.slots, device="cuda")[: a.experts]

    def dequant() -> None:
        for proj in ("w13", "w2"):
            fmt.dequant(banks, proj, idx, torch.bfloat16)

    values = a.experts * 3 * a.hidden * a.inter  # w13 (2I x H) + w2 (H x I)
    moved = values * (2 + 17 / 32)  # bf16 written, 4-bit values + one scale byte per 32 read
    t = cuda_seconds(dequant, a.reps)
    src = torch.empty(values, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t_copy = cuda_seconds(lambda: dst.copy_(src), a.reps)
    gbs, copy_gbs = moved / t / 1e9, 2 * values * 2 / t_copy / 1e9
    row = {"device": torch.cuda.get_device_name(), "experts": a.experts, "hidden": a.hidden, "inter": a.inter,
           "ms_per_expert": t / a.experts * 1e3, "dequant_gb_s": gbs, "copy_gb_s": copy_gbs,
           "dequant_vs_copy": gbs / copy_gbs}
    print(json.dumps(row))
    print(f"{row['device']}: dequant {row['ms_per_expert']:.3f} ms per expert ({gbs:.0f} GB/s moved), device copy "
          f"{copy_gbs:.0f} GB/s; ratio {gbs / copy_gbs:.2f}")


if __name__ == "__main__":
    main()
