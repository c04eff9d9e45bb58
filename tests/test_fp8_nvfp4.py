"""FP8 and NVFP4 experts: each dequantiser against its layout's reference formula (torch and, under
the Triton interpreter, the kernels), and the Triton decode GEMV against the torch reference."""

from __future__ import annotations

import json

import pytest
import torch

from ferryman.layers.moe_common import TRITON_FORMATS, quant_params
from ferryman.quant import get_format
from ferryman.quant.fp8 import dequant_fp8, random_fp8
from ferryman.quant.linear_layouts import linear_layout
from ferryman.quant.nvfp4 import dequant_nvfp4, random_nvfp4
from moe_cases import slot_pool
from quant_checkpoints import ref_ct_scale, ref_fp8_block, ref_nvfp4
from triton_interp import run_interpreted


def _fp8_codes(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Every e4m3 byte but the NaNs, spread over `shape`."""
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3C
    return b.view(torch.float8_e4m3fn)


def test_fp8_block_equals_transformers_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    q = _fp8_codes((3, 256, 384), gen)
    s = torch.rand(3, 2, 3, generator=gen) * 1e-2
    for dtype in (torch.float32, torch.bfloat16):
        want = torch.stack([ref_fp8_block(q[e], s[e], 128, 128) for e in range(3)]).to(dtype)
        assert torch.equal(dequant_fp8(q, s, (128, 128), dtype), want)


def test_fp8_partial_blocks_round_the_grid_up() -> None:
    """DeepSeek's kv_a_proj_with_mqa has 576 rows: the last row block is partial."""
    gen = torch.Generator().manual_seed(1)
    q, s = _fp8_codes((40, 24), gen), torch.rand(3, 2, generator=gen)  # 16x16 blocks over 40x24
    want = torch.empty(40, 24)
    for r in range(40):
        for c in range(24):
            want[r, c] = q[r, c].float() * s[r // 16, c // 16]
    assert torch.equal(dequant_fp8(q, s, (16, 16), torch.float32), want)
    with pytest.raises(ValueError, match="do not match"):
        dequant_fp8(q, torch.rand(2, 2), (16, 16), torch.float32)


def test_ct_fp8_channel_and_tensor_scales() -> None:
    gen = torch.Generator().manual_seed(2)
    q = _fp8_codes((48, 32), gen)
    for strategy, s in (("channel", torch.rand(48, 1, generator=gen)), ("tensor", torch.rand(1, generator=gen))):
        lay = linear_layout(f"fp8:{strategy}:weight_scale")
        got = lay.dequant({"weight": q, "weight_scale": s}, torch.float32)
        assert torch.equal(got, ref_ct_scale(q, s))
        # compressed-tensors multiplies in the scale's dtype: bf16 scales give bf16 products, and
        # ferryman's fp32 product rounded once to bf16 is the same value
        sb = s.to(torch.bfloat16)
        got = lay.dequant({"weight": q, "weight_scale": sb}, torch.float32).to(torch.bfloat16)
        assert torch.equal(got, ref_ct_scale(q, sb))


@pytest.mark.parametrize("divide", [False, True])
def test_nvfp4_equals_its_layouts_formula(divide: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    packed, scale, g = random_nvfp4((2, 64, 96), 2, divide, gen, "cpu")
    g = g * torch.tensor([[1.0, 3.0]])  # gate and up with their own global scales
    got = dequant_nvfp4(packed, scale, g, divide, torch.float32)
    for e in range(2):
        for part in range(2):
            rows = slice(32 * part, 32 * (part + 1))
            want = ref_nvfp4(packed[e, rows], scale[e, rows], g[e, part], divide)
            assert torch.equal(got[e, rows], want)
    # the other layout's semantics (the reciprocal) is not a rounding away: it is another model
    other = dequant_nvfp4(packed, scale, g, not divide, torch.float32)
    assert (other - got).abs().max() > 10 * got.abs().max()


@pytest.mark.parametrize("name", ["fp8:128x128", "fp8:16x32", "fp8:channel", "nvfp4", "nvfp4-ct"])
def test_format_banks_dequant_per_expert(name: str) -> None:
    fmt = get_format(name)
    gen = torch.Generator().manual_seed(4)
    banks = fmt.random_banks(4, 256, 128, False, torch.float32, gen)
    fmt.check_banks(banks)
    idx = torch.tensor([3, 0, 3])
    for proj in ("w13", "w2"):
        got = fmt.dequant(banks, proj, idx, torch.float32)
        for j, e in enumerate(idx.tolist()):
            assert torch.equal(got[j], fmt.dequant(banks, proj, slice(e, e + 1), torch.float32)[0])
        assert 0.3 < got.std().item() * got.shape[-1] ** 0.5 < 3  # random weights of std ~ 1/sqrt(k)


def test_fp8_block_format_needs_whole_row_blocks_for_gate_and_up() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        get_format("fp8:128x128").bank_specs(2, 256, 96, False, torch.bfloat16)


def test_decode_kernel_flags() -> None:
    assert quant_params("fp8:128x128") == dict(QF=1, QA=128, QB=128)
    assert quant_params("fp8:channel") == dict(QF=1, QA=1, QB=0)
    assert quant_params("nvfp4-ct")["QA"] == 1 and quant_params("nvfp4")["QA"] == 0
    assert {"fp8:128x128", "nvfp4", "nvfp4-ct", "fp8:channel"} <= set(TRITON_FORMATS)


_DEQUANT = """
import torch
from ferryman.quant import get_format
from ferryman.quant.layout import ExpertLayout
from ferryman.quant.fp8 import dequant_fp8
from ferryman.quant.fp8_triton import dequant_fp8_rows
from ferryman.quant.nvfp4 import dequant_nvfp4
from ferryman.quant.nvfp4_triton import dequant_nvfp4_rows
g = torch.Generator().manual_seed(7)
for name in ("fp8:128x128", "fp8:16x32", "fp8:channel", "nvfp4", "nvfp4-ct"):
    fmt = get_format(name)
    # (hidden, inter): 80 leaves a partial last block of 32 inputs, 160 one of 128
    hidden, inter = {"fp8:16x32": (80, 48), "fp8:128x128": (160, 128)}.get(name, (64, 48))
    layout = ExpertLayout.of(fmt.bank_specs(5, hidden, inter, False, torch.float32))
    banks = layout.views(torch.zeros(5, layout.row_bytes, dtype=torch.uint8))  # strided: the slot pool
    for k, v in fmt.random_weights(5, hidden, inter, torch.float32, g, "cpu").items():
        banks[k].copy_(v)
    if name.startswith("fp8"):  # every e4m3 byte but NaN, subnormals included
        for p in ("w13", "w2"):
            b = torch.randint(0, 256, banks[p].shape, generator=g, dtype=torch.uint8)
            b[(b & 0x7F) == 0x7F] = 0
            banks[p].view(torch.uint8).copy_(b)
    for proj in ("w13", "w2"):
        for idx in (slice(1, 3), torch.tensor([4, 0, 4])):
            if name.startswith("fp8"):
                q, s = banks[proj], banks[proj + "_scale"]
                got = dequant_fp8_rows(q, s, idx, fmt.block, torch.float32)
                want = dequant_fp8(q[idx], s[idx], fmt.block, torch.float32)
            else:
                p, s, gs = banks[proj + "_packed"], banks[proj + "_scale"], banks[proj + "_gscale"]
                gs.mul_(torch.tensor([1.0, 1.7])[: gs.shape[1]])
                got = dequant_nvfp4_rows(p, s, gs, idx, fmt.divide, torch.float32)
                want = dequant_nvfp4(p[idx], s[idx], gs[idx], fmt.divide, torch.float32)
            assert got.shape == want.shape and torch.equal(got, want), (name, proj, idx)
print("ok")
"""


def test_triton_dequant_equals_reference_in_interpreter() -> None:
    """The Triton dequantisers (the batched prefill path on CUDA) read strided slot banks in place
    and give the torch reference's values exactly."""
    assert run_interpreted(_DEQUANT).strip().endswith("ok")


_DECODE = """
import json, torch
from moe_cases import random_routing, rel_err, slot_pool
from ferryman.layers.fused_moe_triton import fused_moe_decode
from ferryman.layers.moe_reference import fused_moe_reference
from ferryman.layers.moe_common import MoEActivation
from ferryman.quant import get_format
e, t, k, h, i = 4, 2, 2, 272, 128  # h: a partial last K step for both tile loaders
out = []
for seed, (fmt, dtype) in enumerate([("fp8:128x128", torch.float32), ("fp8:channel", torch.bfloat16),
                                     ("nvfp4", torch.float32), ("nvfp4-ct", torch.float32)]):
    gen = torch.Generator().manual_seed(seed)
    form = get_format(fmt)
    banks = form.random_banks(e, h, i, False, dtype, gen)
    if "w13_gscale" in banks:
        banks["w13_gscale"][:, 1] *= 1.5  # gate and up with different global scales
    x = torch.randn(t, h, generator=gen).to(dtype)
    ids, w = random_routing(e, t, k, gen)
    act = MoEActivation("silu")
    ref = fused_moe_reference(form, banks, x, ids, w, act)
    got = fused_moe_decode(fmt, slot_pool(form, banks, h, i, False, dtype), x, ids, w, "silu", act.alpha, act.limit)
    out.append(dict(case=fmt, err=rel_err(got, ref), dtype=str(dtype), ok=got.dtype == dtype and got.shape == x.shape))
print(json.dumps(out))
"""


def test_triton_decode_matches_reference_in_interpreter() -> None:
    """The decode GEMV's fp8 and nvfp4 tile loaders on strided slot banks, against the torch path."""
    tol = {"torch.float32": 1e-5, "torch.bfloat16": 3e-2}
    for case in json.loads(run_interpreted(_DECODE).strip().splitlines()[-1]):
        assert case["ok"], case
        assert case["err"] < tol[case["dtype"]], case


def _slot_pool(name: str, e: int, h: int, i: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """Random banks, and the same in an expert-major pool on CUDA (as the slot cache holds them)."""
    fmt = get_format(name)
    banks = fmt.random_banks(e, h, i, False, dtype, torch.Generator().manual_seed(11))
    return banks, slot_pool(fmt, {k: v.cuda() for k, v in banks.items()}, h, i, False, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8:128x128", "fp8:channel", "nvfp4", "nvfp4-ct"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_dequant_equals_reference_at_qwen3_30b_shapes(name: str, dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    banks, pool = _slot_pool(name, 6, 2048, 768, dtype)
    fmt = get_format(name)
    idx = torch.tensor([5, 0, 3, 5])
    for proj in ("w13", "w2"):
        got = fmt.dequant(pool, proj, idx.cuda(), dtype)  # the Triton dequantiser, in place
        want = fmt.dequant(banks, proj, idx, dtype)  # the torch reference on the CPU
        assert torch.equal(got.cpu(), want), (name, proj)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8:128x128", "fp8:channel", "nvfp4", "nvfp4-ct"])
@pytest.mark.parametrize("tokens", [1, 4, 200])
def test_gpu_fused_moe_matches_reference(name: str, tokens: int) -> None:
    """Decode GEMV (1 and 4 tokens of top-8) and the batched prefill path (200 tokens) on the slot
    pool, against the torch reference in fp32 on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ferryman.layers.fused_moe import fused_moe
    from ferryman.layers.moe_common import MoEActivation
    from ferryman.layers.moe_reference import fused_moe_reference

    banks, pool = _slot_pool(name, 16, 2048, 768, torch.bfloat16)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 2048, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(16, generator=gen)[:8] for _ in range(tokens)]).int()
    w = torch.softmax(torch.randn(tokens, 8, generator=gen), -1)
    act = MoEActivation("silu")
    ref = fused_moe_reference(get_format(name), banks, x.float(), ids, w, act)
    got = fused_moe(name, pool, x.cuda(), ids.cuda(), w.cuda(), act).float().cpu()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 2e-2, (name, tokens, err)
