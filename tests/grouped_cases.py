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
from ferryman.quant import Banks, get_format
from ferryman.quant.layout import ExpertLayout


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


def strided(banks: Banks, fmt: str, h: int, i: int, dtype: torch.dtype) -> Banks:
    """The same banks as views into one row of bytes per slot (the expert-major cache pool)."""
    first = next(iter(banks.values()))
    layout = ExpertLayout.of(get_format(fmt).bank_specs(first.shape[0], h, i, True, dtype))
    flat = torch.zeros(first.shape[0], layout.row_bytes, dtype=torch.uint8, device=first.device)
    views = layout.views(flat)
    for name, t in banks.items():
        views[name].copy_(t)
    return views


def run_case(c: Case, device: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    form = get_format(c.fmt)
    wgen = torch.Generator(device=device).manual_seed(seed)  # weights drawn where they are used
    banks = form.random_banks(c.experts, c.hidden, c.inter, True, c.dtype, wgen, device)
    if c.layout == "strided":
        banks = strided(banks, c.fmt, c.hidden, c.inter, c.dtype)
    x = (torch.randn(c.tokens, c.hidden, generator=gen) * 3).to(c.dtype).to(device)
    ids = torch.stack([torch.randperm(c.experts, generator=gen)[:c.top_k] for _ in range(c.tokens)]).int().to(device)
    w = torch.softmax(torch.randn(c.tokens, c.top_k, generator=gen), -1).to(device)
    act = MoEActivation(c.kind)
    got = grouped_moe(c.fmt, banks, x, ids, w, act, cfg=c.cfg)
    ref = fused_moe_reference(form, banks, x, ids, w, act)
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    return dict(case=f"{c.fmt}-{c.kind}-{c.dtype}-{c.layout}-H{c.hidden}-I{c.inter}-BK{c.cfg.block_k}", err=err,
                dtype=str(c.dtype), dtype_ok=got.dtype == c.dtype)
