"""The grouped GEMM's check against the torch reference, for the interpreter scripts (imported in a
child process with TRITON_INTERPRET=1, tests/triton_interp.py) and the GPU tests alike.

    run_case(Case(...), device) -> {"case", "err", "dtype", "dtype_ok"}

Random banks of the format (biases included), random inputs scaled by 3 and distinct top-k slots;
err = |grouped - fused_moe_reference| / |reference| (the reference: the format's dequant + matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferryman.layers.grouped_moe_triton import GroupedConfig, grouped_moe
from ferryman.layers.moe_common import MoEActivation
from ferryman.layers.moe_reference import fused_moe_reference
from ferryman.quant import get_format
from moe_cases import random_routing, rel_err, slot_pool


@dataclass(frozen=True)
class Case:
    fmt: str
    kind: str  # MoEActivation kind
    dtype: torch.dtype
    layout: str  # "contiguous" or "strided" (the expert-major slot pool)
    experts: int
    hidden: int
    inter: int
    tokens: int
    top_k: int
    cfg: GroupedConfig = GroupedConfig()


def run_case(c: Case, device: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    form = get_format(c.fmt)
    wgen = torch.Generator(device=device).manual_seed(seed)  # weights drawn where they are used
    banks = form.random_banks(c.experts, c.hidden, c.inter, True, c.dtype, wgen, device)
    if c.layout == "strided":
        banks = slot_pool(form, banks, c.hidden, c.inter, True, c.dtype)  # the expert-major cache pool
    x = (torch.randn(c.tokens, c.hidden, generator=gen) * 3).to(c.dtype).to(device)
    ids, w = (a.to(device) for a in random_routing(c.experts, c.tokens, c.top_k, gen))
    act = MoEActivation(c.kind)
    got = grouped_moe(c.fmt, banks, x, ids, w, act, cfg=c.cfg)
    ref = fused_moe_reference(form, banks, x, ids, w, act)
    return dict(case=f"{c.fmt}-{c.kind}-{c.dtype}-{c.layout}-H{c.hidden}-I{c.inter}-BK{c.cfg.block_k}",
                err=rel_err(got, ref), dtype=str(c.dtype), dtype_ok=got.dtype == c.dtype)
