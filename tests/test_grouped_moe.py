"""grouped_moe (ferryman/layers/grouped_moe_triton.py) against the torch reference `fused_moe_reference`
(itself checked against transformers in test_fused_moe.py): dense and MXFP4 with biases, contiguous
banks and the strided slot banks of the expert-major cache pool. Interpreter on CPU in a
subprocess; compiled on CUDA (gpu). And which prefill path fused_moe takes."""

from __future__ import annotations

import json

import pytest
import torch

from ferryman.layers.moe_common import MoEActivation
from ferryman.layers.moe_reference import fused_moe_reference
from moe_cases import check_cases, spy_prefill_paths
from triton_interp import run_interpreted, use_kernels

# Triton 3.6's interpreter multiplies bf16 tl.dot operands as raw integers, so the kernels are
# checked in fp32/fp16 here and in bf16 on the GPU (the case runner: tests/grouped_cases.py).
_INTERP = """
import json, torch
from grouped_cases import Case, run_case
from ferryman.layers.grouped_moe_triton import GroupedConfig
cases = [("dense", "silu", torch.float32, "contiguous"),
         ("dense", "swiglu_oai", torch.float16, "strided"),
         ("mxfp4", "swiglu_oai", torch.float32, "strided"),
         ("mxfp4", "silu", torch.float16, "contiguous")]
# H = 96 with BLOCK_K = 64: a partial K step and MXFP4 scale group; 18 pairs over 5 slots: partial
# and several blocks
cfg = GroupedConfig(block_m=16, block_n=32, block_k=64)
out = [run_case(Case(fmt, kind, dtype, layout, 5, 96, 64, 9, 2, cfg), "cpu", seed)
       for seed, (fmt, kind, dtype, layout) in enumerate(cases)]
print(json.dumps(out))
"""

def test_grouped_moe_matches_reference_in_interpreter() -> None:
    check_cases(json.loads(run_interpreted(_INTERP).strip().splitlines()[-1]))


@pytest.mark.parametrize("fmt, pairs, kernels, path", [
    ("dense", 68, None, "grouped"), ("dense", 32768, None, "grouped"), ("dense", None, None, "grouped"),
    ("mxfp4", 68, None, "grouped"), ("mxfp4", 2048, None, "grouped"), ("mxfp4", 2049, None, "batched"),
    ("mxfp4", None, None, "batched"), ("q4_k", 68, None, "batched"),
    ("dense", 68, "triton", "grouped"), ("dense", 68, "torch", "batched"), ("mxfp4", 68, "torch", "batched"),
])
def test_prefill_path_by_format_pairs_and_kernels(fmt: str, pairs: int | None, kernels: str | None,
                                                  path: str) -> None:
    """Unquantised experts take the grouped GEMM at any size, MXFP4 ones up to 2048 (token, k)
    pairs (the batched path above, and with no count); formats it does not read, and any format with
    FERRYMAN_KERNELS=torch, the batched path (the other packed formats: test_grouped_moe_quant.py)."""
    pytest.importorskip("triton")
    from ferryman.layers.fused_moe import prefill_path

    assert prefill_path(fmt, pairs, kernels) == path


def test_prefill_path_reads_ferryman_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from ferryman.layers.fused_moe import prefill_path

    use_kernels(monkeypatch, "auto")
    assert prefill_path("dense") == "grouped"
    use_kernels(monkeypatch, "torch")
    assert prefill_path("dense") == "batched"


def test_grouped_moe_rejects_bad_arguments() -> None:
    pytest.importorskip("triton")
    from ferryman.layers.grouped_moe_triton import GroupedConfig, grouped_moe

    banks = {"w13": torch.zeros(2, 64, 32), "w2": torch.zeros(2, 32, 32)}
    x, ids, w = torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    with pytest.raises(ValueError, match="no kernel for expert format 'q4_k'"):
        grouped_moe("q4_k", banks, x, ids, w, MoEActivation())
    with pytest.raises(ValueError, match="power of two"):
        GroupedConfig(block_m=24)
    with pytest.raises(ValueError, match="block_k must be >= 32"):
        GroupedConfig(block_k=16)
    with pytest.raises(ValueError, match="topk_ids must be"):
        grouped_moe("dense", banks, x, torch.zeros(2, 1, dtype=torch.int32), w, MoEActivation())


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 300])
def test_grouped_moe_on_cuda_gpt_oss_20b_layer(t: int) -> None:
    from grouped_cases import Case, run_case

    cases = [Case(fmt, kind, dtype, layout, 32, 2880, 2880, t, 4)
             for fmt, kind in (("mxfp4", "swiglu_oai"), ("dense", "silu"))
             for dtype in (torch.bfloat16, torch.float32) for layout in ("contiguous", "strided")]
    check_cases([run_case(c, "cuda", seed) for seed, c in enumerate(cases)])


@pytest.mark.gpu
def test_prefill_through_grouped_gemm_equals_batched(tiny: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed prefill batches (> 64 pairs) through the grouped GEMM score what the batched path
    (checked against the reference in test_batched_moe.py) scores, for every tiny architecture."""
    from ferryman import LLM
    from ferryman.layers import fused_moe as fm

    arch, folder = tiny
    prompts = [[5, 17, 42, 7, 99] * 6, list(range(20, 60)), [(i * 37) % 250 + 3 for i in range(29)]]
    kw = dict(device="cuda", dtype="float32", enforce_eager=True)
    scores = {}
    for path in ("batched", "grouped"):
        monkeypatch.setattr(fm, "prefill_path", lambda fmt, pairs=None, kernels=None, path=path: path)
        scores[path] = LLM(str(folder), **kw).score(prompts)
    for a, b in zip(scores["grouped"], scores["batched"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item()), arch


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, t, taken", [("dense", 40, "grouped"), ("dense", 1000, "grouped"),
                                            ("mxfp4", 40, "grouped"), ("mxfp4", 1024, "grouped"),
                                            ("mxfp4", 1025, "batched")])
def test_cuda_default_prefill_dispatch(fmt: str, t: int, taken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the defaults, a call of more than 64 pairs on CUDA reaches the kernel prefill_path names
    for its format and pair count (top-2 here: 1024 tokens = 2048 pairs), and equals the reference."""
    import ferryman.layers.fused_moe as fm
    from ferryman.quant import get_format

    calls = spy_prefill_paths(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    form, act = get_format(fmt), MoEActivation("silu")
    banks = form.random_banks(8, 128, 64, True, torch.bfloat16, gen, "cuda")
    x = torch.randn(t, 128, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(t, 8, device="cuda", generator=gen).topk(2, dim=-1).indices.to(torch.int32)  # 2t pairs
    w = torch.softmax(torch.randn(t, 2, device="cuda", generator=gen), -1)
    out = fm.fused_moe(fmt, banks, x, ids, w, act)
    ref = fused_moe_reference(form, banks, x, ids, w, act)
    assert calls == [taken]
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 3e-2
