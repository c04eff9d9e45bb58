"""The CPU expert kernel's packed formats (quant/csrc/cpu_experts_packed.h, cpu_experts_rows512.h): GGUF q8_0 / q4_k / q6_k
blocks, int4 / int8 words with group scales, fp8 e4m3 with block or row scales, nvfp4 (modelopt's and
compressed-tensors' global scales). Per format and instruction set: every decoded weight bit for bit
the torch dequantiser's (quant/gguf_blocks.py dequant_rows, quant/intq.py, quant/fp8.py,
quant/nvfp4.py); whole layers (1, 4, 5, 9 tokens; K not a multiple of the 1024-wide tiles) against
fused_moe's torch path in float64 from the same weights; fused_moe on the CPU takes the kernel for
them, and the variants it does not read (act-order int, other GGUF types, non-square fp8 blocks)
keep the torch path."""

from __future__ import annotations

import pytest
import torch

from ferryman.layers.fused_moe import MoEActivation, fused_moe
from ferryman.quant import cpu_kernel, get_format
from ferryman.quant.cpu_layer import LayerJob, kernel_reads
from triton_interp import use_cpu_kernel

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler to build the CPU kernel")
ISAS = ["avx512bf16", "avx512", "avx2", "portable"]
TOKENS = [1, 4, 5, 9]
# w13 and w2 of different GGUF types in one layer; int sym / asym / one group per row, 4 and 8 bits
FORMATS = ["gguf:q8_0:q8_0", "gguf:q4_k:q6_k", "gguf:q6_k:q4_k", "int4:g128:sym", "int4:g32:asym", "int4:ch:sym",
           "int8:g128:asym", "fp8:128x128", "fp8:channel", "nvfp4", "nvfp4-ct"]
HIDDEN, INTER = 1280, 256  # w13's K: one tile of 1024 and one of 256; w2's: a single short tile


def _banks(fmt: str, seed: int, experts: int = 4, hidden: int = HIDDEN) -> dict[str, torch.Tensor]:
    banks = get_format(fmt).random_banks(experts, hidden, INTER, True, torch.float32,
                                         torch.Generator().manual_seed(seed))
    if "w13_gscale" in banks:  # nvfp4: gate's and up's global scales differ (random ones are equal)
        banks["w13_gscale"][:, 1] *= 2.0
    return banks


def _w13_matrix(fmt: str, banks: dict[str, torch.Tensor], e: int) -> tuple[torch.Tensor, ...]:
    """(weights, scales, zeros) of expert e's w13 as cpu_kernel.matmul takes them."""
    if fmt.startswith("gguf"):
        return banks["w13_q"][e], None, None
    if fmt.startswith("fp8"):
        return banks["w13"][e], banks["w13_scale"][e], None
    if fmt.startswith("nvfp4"):
        return banks["w13_packed"][e], banks["w13_scale"][e], banks["w13_gscale"][e]
    zeros = banks.get("w13_zeros")
    return banks["w13_qweight"][e], banks["w13_scales"][e], None if zeros is None else zeros[e]


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", ISAS)
def test_decoded_weights_are_the_dequantisers_bit_for_bit(fmt: str, isa: str) -> None:
    """The identity's K tokens times W give W^T exactly (each sum is one product and zeros), so every
    decoded weight of the kernel is compared with the torch reference's, bit for bit."""
    banks = _banks(fmt, 1, experts=2)
    w, s, z = _w13_matrix(fmt, banks, 1)
    got = cpu_kernel.matmul(torch.eye(HIDDEN), w, s, fmt=fmt, isa=isa, zeros=z).T  # [2I, H]
    want = get_format(fmt).dequant(banks, "w13", slice(1, 2), torch.float32)[0]  # [2I, H]
    assert got.shape == want.shape and bool(want.abs().amax() > 0)
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {want.numel()} weights differ"


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens", [1, 8])  # the row decoders, then the tiles
def test_every_fp8_code_decodes_exactly(isa: str, tokens: int) -> None:
    """Every e4m3 code but the two NaNs (subnormals, zeros of both signs, the largest) in every row,
    shifted per row, with row scales spanning magnitudes: W^T through the identity is the
    dequantiser's bit for bit (the AVX-512 paths widen codes through fp16)."""
    fmt = "fp8:channel"
    banks = _banks(fmt, 3, experts=1)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # [254]
    rows = banks["w13"].shape[1]
    idx = (torch.arange(HIDDEN)[None, :] + torch.arange(rows)[:, None] * 7) % codes.numel()
    banks["w13"][0] = codes[idx].view(banks["w13"].dtype)
    banks["w13_scale"][0] = torch.logspace(-6, 3, rows, base=2.0).reshape(banks["w13_scale"][0].shape)
    w, s, z = _w13_matrix(fmt, banks, 0)
    eye = torch.eye(HIDDEN)
    got = torch.cat([cpu_kernel.matmul(eye[k:k + tokens], w, s, fmt=fmt, isa=isa, zeros=z)
                     for k in range(0, HIDDEN, tokens)]).T
    want = get_format(fmt).dequant(banks, "w13", slice(0, 1), torch.float32)[0]
    assert bool((want == 0).any()) and bool((want.abs() < 2.0 ** -9).any())  # zeros and subnormal codes
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {want.numel()} weights differ"


@needs_kernel
@pytest.mark.parametrize("fmt,hidden", [(f, HIDDEN) for f in FORMATS]  # nvfp4 at 1296: an odd last group
                         + [("int4:g8:asym", 1288), ("int8:ch:asym", 1288), ("fp8:channel", 1288), ("nvfp4", 1296)]
                         # int4's AVX-512 spans: groups of 32 without zeros, a row's tail after its spans
                         + [("int4:g32:sym", HIDDEN), ("int4:ch:sym", 1288)])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("tokens", [3, 5, 7])  # 5: chunks of K end mid-block (1152 of 1280)
def test_few_token_paths_decode_bit_for_bit(fmt: str, hidden: int, isa: str, tokens: int) -> None:
    """3, 5 and 7 tokens per call, below the tiles' TILES_FROM: the row decoders where a format has them
    (every packed format on AVX-512 and AVX2), tiles elsewhere; groups of 8 and rows that end inside a
    vector take the row decoders' scalar tails. Tokens of the identity give columns of W exactly."""
    banks = _banks(fmt, 2, experts=1, hidden=hidden)
    w, s, z = _w13_matrix(fmt, banks, 0)
    eye = torch.eye(hidden)
    got = torch.cat([cpu_kernel.matmul(eye[k:k + tokens], w, s, fmt=fmt, isa=isa, zeros=z)
                     for k in range(0, hidden, tokens)])
    want = get_format(fmt).dequant(banks, "w13", slice(0, 1), torch.float32)[0]  # [2I, H]
    assert torch.equal(got.T, want), f"{(got.T != want).sum().item()} of {want.numel()} weights differ"


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("isa", ISAS)
def test_layer_matches_fused_moe_torch_path(fmt: str, tokens: int, isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One layer (silu, biases) in one kernel call against fused_moe's torch path over the same pairs,
    in float64 from the dequantised weights (the biases' dtype is the reference's compute dtype)."""
    banks = _banks(fmt, tokens)
    gen = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])  # [T, 2]
    w = torch.rand(tokens, 2, generator=gen)
    act = MoEActivation("silu")
    got = LayerJob(x, banks, 0, cpu_kernel.pairs_of(ids, w), "silu", act.alpha, act.limit, fmt=fmt).run(isa)
    use_cpu_kernel(monkeypatch, False)
    wide = {name: (b.double() if name.endswith("_bias") else b) for name, b in banks.items()}
    want = fused_moe(fmt, wide, x.double(), ids, w.double(), act)
    assert bool(want.abs().amax() > 1e-2)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("fmt", ["gguf:q8_0:q6_k", "int4:g128:asym"])
def test_swiglu_oai_layer_matches(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    banks = _banks(fmt, 7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, HIDDEN, generator=gen) * 3  # some gates past the limit
    ids, w = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(5)]), torch.rand(5, 2, generator=gen)
    act = MoEActivation("swiglu_oai")
    got = LayerJob(x, banks, 0, cpu_kernel.pairs_of(ids, w), act.kind, act.alpha, act.limit, fmt=fmt).run()
    use_cpu_kernel(monkeypatch, False)
    wide = {name: (b.double() if name.endswith("_bias") else b) for name, b in banks.items()}
    torch.testing.assert_close(got.double(), fused_moe(fmt, wide, x.double(), ids, w.double(), act),
                               rtol=1e-4, atol=1e-5)


def _count_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    inner = LayerJob.run
    monkeypatch.setattr(LayerJob, "run", lambda job, *a: calls.__setitem__(0, calls[0] + 1) or inner(job, *a))
    return calls


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_moe_on_cpu_takes_the_kernel(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 activations, as an engine has them: one kernel call for the layer, within bf16 rounding of
    the torch path (which rounds the weights and products to bf16)."""
    banks = _banks(fmt, 3)
    banks = {n: (b.bfloat16() if n.endswith("_bias") else b) for n, b in banks.items()}
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, HIDDEN, generator=gen).bfloat16()
    ids, w = torch.tensor([[0, 3], [3, 2], [1, 0], [2, 1], [3, 1]]), torch.rand(5, 2, generator=gen)
    act = MoEActivation("silu")
    calls = _count_runs(monkeypatch)
    assert kernel_reads(fmt, banks)
    fast = fused_moe(fmt, banks, x, ids, w, act)
    assert calls[0] == 1 and fast.dtype == torch.bfloat16
    use_cpu_kernel(monkeypatch, False)
    slow = fused_moe(fmt, banks, x, ids, w, act)
    assert calls[0] == 1
    torch.testing.assert_close(fast.float(), slow.float(), rtol=3e-2, atol=6e-2)


@needs_kernel
@pytest.mark.parametrize("fmt", ["int4:g128:sym:act", "gguf:q5_k:q8_0", "gguf:q8_0:q4_0", "fp8:128x64"])
def test_variants_without_a_decoder_keep_the_torch_path(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    banks = _banks(fmt, 5)
    x = torch.randn(3, HIDDEN)
    ids, w = torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2)
    calls = _count_runs(monkeypatch)
    assert not kernel_reads(fmt, banks) and cpu_kernel.packed_codes(fmt) is None
    out = fused_moe(fmt, banks, x, ids, w, MoEActivation("silu"))
    assert calls[0] == 0 and out.shape == x.shape and bool(torch.isfinite(out).all())
    with pytest.raises(ValueError, match="no CPU kernel"):
        LayerJob(x, banks, 0, cpu_kernel.pairs_of(ids, w), "silu", 1.0, 1.0, fmt=fmt)


@needs_kernel
def test_layer_job_names_a_bank_of_the_wrong_shape() -> None:
    banks = _banks("int4:g128:sym", 6)
    banks["w2_scales"] = banks["w2_scales"][:, :, :1].contiguous()
    pairs = cpu_kernel.pairs_of(torch.tensor([[0, 1]]), torch.rand(1, 2))
    with pytest.raises(ValueError, match=r"w2_scales \(4, 1280, 1\)"):
        LayerJob(torch.randn(1, HIDDEN), banks, 0, pairs, "silu", 1.0, 1.0, fmt="int4:g128:sym")


@needs_kernel
@pytest.mark.parametrize("fmt,hidden,inter", [("int4:g192:asym", 1152, 384), ("int4:g96:sym", 1152, 384),
                                              ("fp8:96x96", 1000, 192),
                                              ("int4:g8:asym", 1288, 256), ("int4:ch:sym", 1288, 256),
                                              ("nvfp4", 1296, 256), ("nvfp4-ct", 1296, 256)])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens", [3, 0])  # 3 per call: the row decoders; 0: all at once, the tiles
def test_groups_across_tile_edges(fmt: str, hidden: int, inter: int, isa: str, tokens: int) -> None:
    """Groups of 192 and 96 / blocks of 96 inputs: the 1024-wide tiles and int4's 128-value spans (and
    AVX2's 64-value halves, for groups of 96) end inside a group (its scale read on both sides); fp8's
    last block of a row is partial (1000 = 10 x 96 + 40); int4 rows of 1288 and nvfp4 rows of 1296 end
    8 and 16 values after their last span. Decoded bit for bit."""
    banks = get_format(fmt).random_banks(1, hidden, inter, False, torch.float32, torch.Generator().manual_seed(9))
    w, s, z = _w13_matrix(fmt, banks, 0)
    eye, step = torch.eye(hidden), tokens or hidden
    got = torch.cat([cpu_kernel.matmul(eye[k:k + step], w, s, fmt=fmt, isa=isa, zeros=z)
                     for k in range(0, hidden, step)]).T  # [2I, H]
    assert torch.equal(got, get_format(fmt).dequant(banks, "w13", slice(0, 1), torch.float32)[0])
