"""GGUF block types and the `gguf:*` expert formats: the torch reference against gguf-py's own
dequantiser (bit for bit, on random bytes), random blocks, the format's checks, fused_moe on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferryman.layers.fused_moe import MoEActivation, fused_moe
from ferryman.quant import get_format, gguf_format
from ferryman.quant.gguf_blocks import (BLOCK_SIZES, GGUF_TYPES, dequant_rows, ggml_mxfp4_to_blocks_scales,
                                        random_rows, row_bytes, rows_from_numpy)
from ferryman.quant.mxfp4 import dequant_mxfp4
from triton_interp import use_cpu_kernel

gguf = pytest.importorskip("gguf")


def _qtype(name: str) -> "gguf.GGMLQuantizationType":
    return gguf.GGMLQuantizationType[name.upper()]


def _theirs(raw: torch.Tensor, name: str) -> torch.Tensor:
    with np.errstate(all="ignore"):  # random bytes hold fp16 NaN/inf scales
        return torch.from_numpy(np.array(gguf.quants.dequantize(raw.numpy(), _qtype(name))))


def assert_same_bits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal bit for bit, NaN where NaN (its payload aside)."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == torch.float32
    nan = theirs.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours[~nan].view(torch.int32), theirs[~nan].view(torch.int32))


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_sizes_match_gguf_py(name: str) -> None:
    assert gguf.GGML_QUANT_SIZES[_qtype(name)] == BLOCK_SIZES[name]


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_dequant_equals_gguf_py_on_random_bytes(name: str) -> None:
    bs = BLOCK_SIZES[name][0]
    k = 2 * bs if bs > 1 else 48
    raw = torch.randint(0, 256, (3, 7, row_bytes(name, k)), generator=torch.Generator().manual_seed(1),
                        dtype=torch.uint8)
    assert_same_bits(dequant_rows(raw, name), _theirs(raw, name))


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_random_rows_are_valid_and_scaled(name: str) -> None:
    k = 1024
    raw = random_rows(name, (48, k), torch.Generator().manual_seed(2))
    assert raw.shape == (48, row_bytes(name, k)) and raw.dtype == torch.uint8
    vals = dequant_rows(raw, name)
    assert_same_bits(vals, _theirs(raw, name))
    assert vals.isfinite().all()
    assert 0.8 < vals.std().item() * k ** 0.5 < 1.25
    assert abs(vals.mean().item()) * k ** 0.5 < 0.15  # q4_0, iq4_nl: codes -8..7 lean to minus


def test_rows_from_numpy_shares_memory() -> None:
    data = np.arange(4 * 144, dtype=np.uint8).reshape(2, 2, 144)  # gguf-py's [..., bytes] of a Q4_K tensor
    rows = rows_from_numpy(data, "q4_k")
    assert rows.shape == (4, 144) and rows.data_ptr() == data.ctypes.data
    floats = np.ones((3, 8), dtype=np.float16)
    assert rows_from_numpy(floats, "f16").shape == (3, 16)
    with pytest.raises(ValueError, match="q6_k"):
        rows_from_numpy(data, "q6_k")


def test_ggml_mxfp4_repack_is_lossless() -> None:
    raw = torch.randint(0, 256, (5, 3 * 17), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    raw[:, 0::17] = raw[:, 0::17].clamp(10, 240)  # normal values: both sides exact
    blocks, scales = ggml_mxfp4_to_blocks_scales(raw)
    assert blocks.shape == (5, 3, 16) and scales.shape == (5, 3)
    ours, theirs = dequant_mxfp4(blocks, scales, torch.float32), _theirs(raw, "mxfp4")
    assert torch.equal(ours, theirs)  # equal values (ferryman's code 8 is -0.0, ggml's +0.0)


def test_unsupported_type_is_named() -> None:
    with pytest.raises(ValueError, match="'iq2_xxs'"):
        dequant_rows(torch.zeros(4, 66, dtype=torch.uint8), "iq2_xxs")
    with pytest.raises(ValueError, match="'q9_k'"):
        get_format("gguf:q4_k:q9_k")
    with pytest.raises(ValueError, match="gguf:<w13_type>:<w2_type>"):
        get_format("gguf:q4_k")


def test_format_banks_and_dims() -> None:
    fmt = gguf_format("q4_k", "q6_k")
    assert fmt.name == "gguf:q4_k:q6_k" and get_format("gguf:q4_k:q6_k") is fmt
    specs = fmt.bank_specs(4, 512, 256, True, torch.bfloat16)
    assert specs["w13_q"].shape == (4, 512, 2 * 144) and specs["w2_q"].shape == (4, 512, 210)
    assert specs["w13_q"].dtype == torch.uint8 and specs["w2_bias"].shape == (4, 512)
    banks = fmt.random_banks(4, 512, 256, True, torch.bfloat16, torch.Generator().manual_seed(4))
    fmt.check_banks(banks)
    assert fmt.dims(banks) == (4, 512, 256)
    assert fmt.expert_bytes(512, 256, False, torch.bfloat16) == 512 * 288 + 512 * 210
    with pytest.raises(ValueError, match="expert FFN size 96 .* q6_k block size 256"):
        fmt.bank_specs(4, 512, 96, False, torch.bfloat16)
    with pytest.raises(ValueError, match="hidden size 100 .* q4_k block size 256"):
        fmt.bank_specs(4, 100, 256, False, torch.bfloat16)


@pytest.mark.parametrize("types", [("q8_0", "q5_1"), ("q4_k", "q6_k"), ("iq4_xs", "q2_k")])
def test_format_dequant_selects_experts(types: tuple[str, str]) -> None:
    fmt = gguf_format(*types)
    banks = fmt.random_banks(5, 256, 256, False, torch.float32, torch.Generator().manual_seed(5))
    idx = torch.tensor([4, 1, 4])
    for proj in ("w13", "w2"):
        got = fmt.dequant(banks, proj, idx, torch.bfloat16)
        want = dequant_rows(banks[f"{proj}_q"][idx], fmt.types[proj]).to(torch.bfloat16)
        assert torch.equal(got, want)
    assert fmt.dequant(banks, "w13", slice(0, 2)).shape == (2, 512, 256)


@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
def test_fused_moe_equals_dense_of_dequantised(act: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fused_moe on GGUF banks = fused_moe on the dense banks holding their dequantised weights, both
    on the torch path (dense experts would take the C kernel, which sums in another order)."""
    use_cpu_kernel(monkeypatch, False)
    fmt = gguf_format("q4_k", "q5_0")
    e, h, i, t, k = 6, 256, 64, 5, 2
    gen = torch.Generator().manual_seed(6)
    banks = fmt.random_banks(e, h, i, act == "swiglu_oai", torch.float32, gen)
    dense = {p: fmt.dequant(banks, p, slice(None), torch.float32) for p in ("w13", "w2")}
    dense.update({n: banks[n] for n in ("w13_bias", "w2_bias") if n in banks})
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)
    ours = fused_moe(fmt.name, banks, x, ids, w, MoEActivation(act))
    want = fused_moe("dense", dense, x, ids, w, MoEActivation(act))
    assert ours.shape == (t, h) and torch.equal(ours, want)


def test_prefill_of_gguf_experts_takes_the_batched_path() -> None:
    """No grouped GEMM reads GGUF blocks: prefill batches of any size dequantise groups of experts
    (Triton on CUDA); decode-sized ones go to the decode GEMVs, which read the blocks."""
    pytest.importorskip("triton")
    from ferryman.layers.fused_moe import prefill_path
    from ferryman.layers.moe_common import triton_reads

    for pairs in (65, 100, 4096, 4097, None):
        assert prefill_path("gguf:q4_k:q6_k", pairs, kernels="auto") == "batched", pairs
    assert triton_reads("gguf:q4_k:q6_k") and triton_reads("mxfp4") and triton_reads("int4:g128:sym")
    assert not triton_reads("fp8:64x32") and not triton_reads("q4_k")
