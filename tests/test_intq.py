"""Integer weight-only formats (quant/intq*.py): each checkpoint layout repacked into the canonical
banks dequantises to exactly its producer's formula (tests/int_checkpoints.py writes the layouts
independently), on the torch path and, under the Triton interpreter, the CUDA kernels; bad inputs
are one-line errors naming the tensor or field."""

from __future__ import annotations

import pytest
import torch
from int_checkpoints import awq_tensors, ct_tensors, gptq_tensors
from triton_interp import run_interpreted

from ferryman.errors import WeightError
from ferryman.quant import get_format
from ferryman.quant.intq import IntFormat, IntParams, pack_codes, parse_name, unpack_codes
from ferryman.quant.intq_layouts import from_awq, from_compressed_tensors, from_gptq, random_packed
from ferryman.quant.intq_schemes import int_scheme

OUT, K = 48, 64  # one linear [out, K]: groups of 16 -> 4 per row


def _source(tensors: dict[str, torch.Tensor], prefix: str = "m.") -> tuple:
    full = {prefix + k: v for k, v in tensors.items()}
    return full.__getitem__, set(full)


def _ct(bits: int, group: int, sym: bool, act: bool):  # noqa: ANN202
    def build(w: torch.Tensor, gen: torch.Generator):  # noqa: ANN202
        t, ref = ct_tensors(w, bits, group, sym, act, gen)
        get, names = _source(t)
        return from_compressed_tensors(IntParams(bits, group, sym, act), "m.", get, names), ref
    return build


def _awq(w: torch.Tensor, gen: torch.Generator):  # noqa: ANN202
    t, ref = awq_tensors(w, 16)
    return from_awq(IntParams(4, 16, False), "m.", _source(t)[0]), ref


def _gptq(bits: int, sym: bool, act: bool):  # noqa: ANN202
    def build(w: torch.Tensor, gen: torch.Generator):  # noqa: ANN202
        t, ref = gptq_tensors(w, bits, 16, sym, act, gen)
        get, names = _source(t)
        return from_gptq(IntParams(bits, 16, sym, act), "m.", get, names, zeros_minus_one=True), ref
    return build


LAYOUTS = {
    "ct-int4-g16-sym": _ct(4, 16, True, False), "ct-int4-g16-asym": _ct(4, 16, False, False),
    "ct-int8-channel-sym": _ct(8, 0, True, False), "ct-int4-channel-asym": _ct(4, 0, False, False),
    "ct-int4-g16-actorder": _ct(4, 16, False, True), "awq": _awq, "gptq-int4-sym": _gptq(4, True, False),
    "gptq-int4-desc-act": _gptq(4, False, True), "gptq-int8-sym": _gptq(8, True, False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_dequantises_to_its_formula(layout: str) -> None:
    """Repacked into the canonical layout, a linear dequantises bit for bit to (q - z) * s of its
    producer; in banks (gate rows then up rows of an expert) the format gives the same values, and
    in bf16 those values rounded once."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(OUT, K, generator=gen) / K**0.5
    packed, ref = LAYOUTS[layout](w, gen)
    assert torch.equal(packed.dequant(torch.float32), ref)
    fmt = get_format(packed.params.name)
    assert isinstance(fmt, IntFormat)
    banks = {n: s.empty() for n, s in fmt.bank_specs(2, K, OUT, False, torch.float32).items()}
    other, ref2 = LAYOUTS[layout](torch.randn(OUT, K, generator=gen) / K**0.5, gen)
    for rows, p in (((0, OUT), packed), ((OUT, 2 * OUT), other)):  # expert 1: gate = packed, up = other
        fmt.write_linear(banks, "w13", 1, rows, p.qweight, p.scales, p.zeros, p.gidx)
    got = fmt.dequant(banks, "w13", torch.tensor([1]), torch.float32)[0]
    assert torch.equal(got, torch.cat([ref, ref2]))
    assert torch.equal(fmt.dequant(banks, "w13", slice(1, 2), torch.bfloat16)[0], torch.cat([ref, ref2]).bfloat16())


def test_pack_round_trip_and_awq_order() -> None:
    codes = torch.randint(0, 16, (3, 64))
    assert torch.equal(unpack_codes(pack_codes(codes, 4), 4), codes.int())
    assert torch.equal(unpack_codes(pack_codes(codes * 16 + 15, 8), 8), (codes * 16 + 15).int())
    # AWQ: nibble i of word j holds output 8j + [0, 2, 4, 6, 1, 3, 5, 7][i]
    word = sum(v << (4 * i) for i, v in enumerate([0, 2, 4, 6, 1, 3, 5, 7]))
    packed = from_awq(IntParams(4, 8, False), "", {"qweight": torch.tensor([[word]], dtype=torch.int32).repeat(8, 1),
                                                   "qzeros": torch.zeros(1, 1, dtype=torch.int32),
                                                   "scales": torch.ones(1, 8, dtype=torch.float16)}.__getitem__)
    assert packed.dequant()[:, 0].tolist() == list(range(8))  # output o holds code o


def test_format_names() -> None:
    assert parse_name("int4:g128:sym") == IntParams(4, 128, True)
    assert parse_name("int8:ch:asym") == IntParams(8, 0, False)
    assert parse_name("int4:g128:asym:act").name == "int4:g128:asym:act"
    for bad in ("int3:g128:sym", "int4:g128", "int4:ch:sym:act", "int4:g12:sym"):
        with pytest.raises(ValueError):
            get_format(bad)
    specs = get_format("int4:g128:asym:act").bank_specs(8, 2048, 768, False, torch.bfloat16)
    assert specs["w13_qweight"].shape == (8, 1536, 256) and specs["w2_scales"].shape == (8, 2048, 6)
    assert specs["w13_gidx"].shape == (8, 2, 2048) and specs["w2_zeros"].dtype == torch.uint8


def test_random_weights_have_the_planned_spread() -> None:
    gen = torch.Generator().manual_seed(0)
    for name in ("int4:g128:sym", "int8:ch:asym", "int4:g64:sym:act"):
        fmt = get_format(name)
        banks = fmt.random_weights(2, 1024, 512, torch.float32, gen, "cpu")
        for proj, k in (("w13", 1024), ("w2", 512)):
            std = fmt.dequant(banks, proj, slice(0, 2), torch.float32).std().item()
            assert 0.5 < std * k**0.5 < 2.0, (name, proj, std)
    linear = random_packed(IntParams(4, 128, False), 96, 1024, gen)
    assert linear.shape == (96, 1024) and 0.5 < linear.dequant().std().item() * 32 < 2.0


@pytest.mark.parametrize("name", ["int4:g32:sym", "int4:g128:asym", "int8:ch:sym"])
def test_random_weights_average_zero(name: str) -> None:
    """Dummy codes are symmetric about the midpoint: uniform codes averaged -0.5 (x the scale), an
    offset shared by every weight that made a gpt-oss-120b dummy repeat one token."""
    gen = torch.Generator().manual_seed(1)
    fmt = get_format(name)
    w = fmt.dequant(fmt.random_weights(4, 2048, 512, torch.float32, gen, "cpu"), "w13", slice(0, 4), torch.float32)
    assert abs(w.mean().item()) < 0.01 * w.std().item()  # [4, 1024, 2048]: the error of the mean is ~0.0003
    linear = random_packed(IntParams(4, 128, True), 512, 2048, gen).dequant()
    assert abs(linear.mean().item()) < 0.01 * linear.std().item()


# ---- bad input ------------------------------------------------------------------------------------


def test_shapes_that_contradict_the_weight_name_the_tensor() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(OUT, K, generator=gen)
    t, _ = ct_tensors(w, 4, 16, False)
    t["weight_scale"] = t["weight_scale"][:, :3]
    get, names = _source(t)
    with pytest.raises(ValueError, match=r"m\.weight_scale: expected \(48, 4\).*got \(48, 3\)"):
        from_compressed_tensors(IntParams(4, 16, False), "m.", get, names)
    a, _ = awq_tensors(w, 16)
    a["qzeros"] = a["qzeros"][:, :2]
    with pytest.raises(ValueError, match=r"m\.qzeros"):
        from_awq(IntParams(4, 16, False), "m.", _source(a)[0])
    g, _ = gptq_tensors(w, 4, 16, False, True, gen)
    g["g_idx"] = g["g_idx"] + 1  # one group too far
    with pytest.raises(ValueError, match=r"m\.g_idx: group indices must lie in \[0, 4\)"):
        from_gptq(IntParams(4, 16, False, True), "m.", *_source(g), zeros_minus_one=True)
    g, _ = gptq_tensors(w, 4, 16, False, True, gen)
    with pytest.raises(ValueError, match=r"m\.g_idx: inputs are not in group order"):
        from_gptq(IntParams(4, 16, False, False), "m.", *_source(g), zeros_minus_one=True)


@pytest.mark.parametrize("qc, field", [
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}}, "strategy 'tensor'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 3, "type": "int", "strategy": "group", "group_size": 128}}}},
     "num_bits 3"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8}}}}, "input_activations"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits 3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
])
def test_unknown_schemes_name_the_field(qc: dict, field: str) -> None:
    from ferryman.errors import ConfigError
    from ferryman.models.registry import model_config
    from tiny_models import COMMON, CONFIGS

    with pytest.raises(ConfigError, match=field):
        model_config({**COMMON, **CONFIGS["qwen3_moe"], "model_type": "qwen3_moe", "quantization_config": qc})


def test_scheme_targets_and_ignore() -> None:
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*mlp\\.gate$"],
          "config_groups": {"a": {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "strategy": "channel"}},
                            "b": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group",
                                                                      "group_size": 128, "symmetric": False}}}}
    s = int_scheme(qc)
    assert s.params_of("model.layers.3.self_attn.q_proj") == IntParams(8, 0, True)
    assert s.params_of("model.layers.3.mlp.experts.7.up_proj") == IntParams(4, 128, False)
    assert s.params_of("model.layers.3.mlp.gate") is None and s.params_of("lm_head") is None
    assert s.expert_params().name == "int4:g128:asym"


def test_a_layer_holds_one_format() -> None:
    from ferryman.experts.store import ExpertStore
    from ferryman.models.base import Target
    from ferryman.models.registry import model_config
    from tiny_models import COMMON, CONFIGS

    qc = {"quant_method": "gptq", "bits": 4, "group_size": 16, "sym": True}
    cfg = model_config({**COMMON, **CONFIGS["qwen3_moe"], "model_type": "qwen3_moe", "quantization_config": qc})
    assert cfg.expert_format == "int4:g16:sym"
    store = ExpertStore(cfg, torch.float32, "cpu")
    name = "model.layers.0.mlp.experts.3.gate_proj.weight"
    with pytest.raises(WeightError, match="experts.3.gate_proj.*packed as int8:ch:sym.*are int4:g16:sym"):
        store.write(Target("expert", "w13", 0, 3, rows=(0, 32)), random_packed(IntParams(8, 0, True), 32, 64), name, "f")
    with pytest.raises(WeightError, match=r"expected shape \[32, 64\], got \[16, 64\]"):
        store.write(Target("expert", "w13", 0, 3, rows=(0, 32)), random_packed(IntParams(4, 16, True), 16, 64), name, "f")


# ---- Triton, under the interpreter ---------------------------------------------------------------

_INTERP = """
import json, torch
from ferryman.quant import get_format
from moe_cases import random_routing, rel_err, slot_pool
from ferryman.quant.intq_triton import dequant_int_rows
from ferryman.layers.fused_moe_triton import BLOCK_K, fused_moe_decode
from ferryman.layers.moe_reference import fused_moe_reference
from ferryman.layers.moe_common import MoEActivation
e, k = 4, 2
out = []
# (format, H, I): groups that split a K step (16, 128), one per row (ch), act-order, a group size
# that is no power of two (48: per-input scales), two K steps with a partial second (H = BLOCK_K + 64)
cases = [("int4:g16:sym", 80, 48, "silu"), ("int4:g16:asym:act", 80, 48, "silu"), ("int8:ch:asym", 72, 40, "swiglu_oai"),
         ("int4:g48:asym", 96, 48, "silu"), ("int4:g64:sym", BLOCK_K + 64, 64, "swiglu_oai"),
         ("int8:g32:sym:act", 64, 32, "silu")]
for seed, (name, h, i, kind) in enumerate(cases):
    gen = torch.Generator().manual_seed(seed)
    form = get_format(name)
    bias = kind == "swiglu_oai"
    banks = form.random_banks(e, h, i, bias, torch.float32, gen)
    strided = slot_pool(form, banks, h, i, bias, torch.float32)
    p = form.params
    for bk_name, bk in (("contiguous", banks), ("strided", strided)):
        for proj in ("w13", "w2"):
            want = form.dequant(banks, proj, torch.tensor([2, 0]), torch.float32)
            args = [bk[f"{proj}_qweight"], bk[f"{proj}_scales"], bk.get(f"{proj}_zeros"), bk.get(f"{proj}_gidx")]
            got = dequant_int_rows(p.bits, p.group, *args, torch.tensor([2, 0]), torch.float32)
            got2 = dequant_int_rows(p.bits, p.group, *args, slice(1, 3), torch.float16)
            want2 = form.dequant(banks, proj, slice(1, 3), torch.float16)
            out.append(dict(case=f"dequant-{name}-{proj}-{bk_name}", exact=bool(torch.equal(got, want))
                            and bool(torch.equal(got2, want2))))
        t = 1 if h > BLOCK_K else 2  # the interpreter runs each program's steps one by one
        x = torch.randn(t, h, generator=gen)
        ids, w = random_routing(e, t, k, gen)
        act = MoEActivation(kind)
        ref = fused_moe_reference(form, banks, x, ids, w, act)
        got = fused_moe_decode(name, bk, x, ids, w, kind, act.alpha, act.limit)
        out.append(dict(case=f"decode-{name}-{kind}-{bk_name}", err=rel_err(got, ref), exact=got.shape == x.shape))
print(json.dumps(out))
"""


def test_triton_kernels_equal_the_reference_in_interpreter() -> None:
    """The in-place dequantiser equals the torch reference bit for bit (fp32 and fp16, by index and
    by slice, contiguous and expert-major strided banks); the decode GEMV within fp32 rounding."""
    import json

    cases = json.loads(run_interpreted(_INTERP).strip().splitlines()[-1])
    assert len(cases) == 6 * 2 * 3
    for case in cases:
        assert case["exact"], case
        assert case.get("err", 0.0) < 1e-5, case


# ---- CUDA ---------------------------------------------------------------------------------------

GPU_FORMATS = ["int4:g128:sym", "int4:g128:asym", "int8:ch:sym", "int4:g128:asym:act", "int4:g32:sym"]


def _qwen3_30b_layer(name: str, dtype: torch.dtype):  # noqa: ANN202
    """16 experts of qwen3-30b-a3b's shape (H 2048, I 768) on CUDA, and the same banks on the CPU."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    banks = get_format(name).random_banks(16, 2048, 768, False, dtype, gen, "cuda")
    return banks, {n: b.cpu() for n, b in banks.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_FORMATS)
def test_gpu_dequant_equals_the_torch_reference(name: str) -> None:
    """The Triton dequantiser (CUDA banks) against the torch one (the same banks on the CPU), bit for bit."""
    banks, host = _qwen3_30b_layer(name, torch.bfloat16)
    fmt = get_format(name)
    for proj in ("w13", "w2"):
        for dtype in (torch.float32, torch.bfloat16):
            got = fmt.dequant(banks, proj, torch.tensor([7, 2, 7], device="cuda"), dtype)
            want = fmt.dequant(host, proj, torch.tensor([7, 2, 7]), dtype)
            assert torch.equal(got.cpu(), want), (name, proj, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_FORMATS)
@pytest.mark.parametrize("t", [1, 4, 40])  # 1, 4: the decode GEMV; 40 tokens of top-8: the batched path
def test_gpu_fused_moe_matches_reference(name: str, t: int) -> None:
    from ferryman.layers.fused_moe import fused_moe
    from ferryman.layers.moe_common import MoEActivation
    from ferryman.layers.moe_reference import fused_moe_reference

    banks, _ = _qwen3_30b_layer(name, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(t, 2048, generator=gen, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(16, generator=gen, device="cuda")[:8] for _ in range(t)]).int()
    w = torch.softmax(torch.randn(t, 8, generator=gen, device="cuda"), -1)
    act = MoEActivation("silu")
    got = fused_moe(name, banks, x, ids, w, act)
    ref = fused_moe_reference(get_format(name), banks, x, ids.long(), w, act)
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert got.dtype == torch.bfloat16 and err < 1e-2, (name, t, err)
