"""Helpers of the MoE kernel tests (also imported by the scripts they run under Triton's
interpreter): random routing, banks as the expert slot pool holds them, the error measure."""

from __future__ import annotations

import torch

from ferryman.quant.base import ExpertFormat
from ferryman.quant.layout import ExpertLayout


def random_routing(e: int, t: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [t, k] int32 (k distinct experts of e per token), then their weights [t, k] (a softmax),
    drawn in that order from `gen`."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int()
    return ids, torch.softmax(torch.randn(t, k, generator=gen), -1)


def slot_pool(form: ExpertFormat, banks: dict[str, torch.Tensor], h: int, i: int, bias: bool,
              dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`banks` copied into an expert-major pool on their device, one row of bytes per expert, as the
    slot cache holds them: strided views under the banks' names."""
    first = next(iter(banks.values()))
    layout = ExpertLayout.of(form.bank_specs(first.shape[0], h, i, bias, dtype))
    pool = layout.views(torch.zeros(first.shape[0], layout.row_bytes, dtype=torch.uint8, device=first.device))
    for name, bank in banks.items():
        pool[name].copy_(bank)
    return pool


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """|got - ref| / |ref| (Frobenius norms, fp32)."""
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


TOL = {"torch.float32": 1e-5, "torch.float16": 5e-3, "torch.bfloat16": 3e-2}  # relative error by dtype


def check_cases(cases: list[dict]) -> None:
    """Each run_case result: its output dtype right and its error within the dtype's tolerance."""
    for case in cases:
        assert case["dtype_ok"], case
        assert case["err"] < TOL[case["dtype"]], case


def spy_prefill_paths(monkeypatch) -> list[str]:  # noqa: ANN001 (pytest.MonkeyPatch)
    """Names of the prefill kernels fused_moe calls from now on ("grouped", "batched"), in order."""
    import ferryman.layers.fused_moe as fm
    import ferryman.layers.grouped_moe_triton as grouped_mod

    calls: list[str] = []
    real_grouped, real_batched = grouped_mod.grouped_moe, fm.fused_moe_batched
    monkeypatch.setattr(grouped_mod, "grouped_moe", lambda *a, **k: calls.append("grouped") or real_grouped(*a, **k))
    monkeypatch.setattr(fm, "fused_moe_batched", lambda *a, **k: calls.append("batched") or real_batched(*a, **k))
    return calls
