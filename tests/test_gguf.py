"""GGUF models: tiny checkpoints written with gguf-py's writer in a spread of tensor types give the
same greedy tokens (CPU, fp32) as transformers running the same values.

The reference is transformers loading the file's values dequantised by gguf-py (`write_gguf`'s
answer, saved as a safetensors folder), for every architecture transformers runs from that folder;
for qwen3moe also transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`). gpt-oss's
reference is ferryman's safetensors path on the original MXFP4 checkpoint (transformers' MXFP4 path
needs accelerate; tests/test_hf_parity.py checks that path against transformers): the GGUF path
must give the same logits bit for bit, since the MXFP4 repack is lossless.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoConfig, AutoModelForCausalLM

from ferryman import LLM, SamplingParams
from ferryman.quant.mxfp4 import dequant_mxfp4
from ferryman.quant.gguf_blocks import ggml_mxfp4_to_blocks_scales
import tiny_models
from gguf_models import mixed, write_gguf, write_reference
from tiny_models import build_tiny, hf_greedy

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# (architecture, expert type, dense-matrix type): every type gguf-py quantises, each on some tensor
# (the tiny models' 64-wide rows take 32-value blocks; Mixtral's 48-wide experts stay float)
CASES = [
    ("qwen3_moe", T.F16, T.Q8_0),
    ("qwen3_moe", T.BF16, T.Q4_0),
    ("mixtral", T.F16, T.Q5_1),
    ("olmoe", T.BF16, T.Q5_0),
    ("olmoe", T.F32, T.Q4_1),
    ("gpt_oss", T.MXFP4, T.BF16),
    ("glm4_moe", T.Q8_0, T.Q4_0),
]


def _build(tmp: Path, arch: str, expert: T, dense: T, **kw) -> tuple[Path, Path]:
    build_tiny(arch, tmp / "hf")
    (tmp / "gguf").mkdir()
    path = tmp / "gguf" / "m.gguf"
    ref = write_gguf(tmp / "hf", arch, path, mixed(expert, dense), **kw)
    return path, write_reference(tmp / "hf", arch, ref, tmp / "ref")


def _greedy(model: str, **kw) -> list[list[int]]:
    llm = LLM(model, device="cpu", dtype="float32", **kw)
    return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, params=GREEDY)]


@pytest.mark.parametrize("arch,expert,dense", CASES, ids=[f"{a}-{e.name}-{d.name}" for a, e, d in CASES])
def test_greedy_matches_reference(tmp_path: Path, arch: str, expert: T, dense: T) -> None:
    path, ref = _build(tmp_path, arch, expert, dense)
    got = _greedy(str(path))
    if arch == "gpt_oss":
        a = LLM(str(path), device="cpu", dtype="float32").score(PROMPTS)
        b = LLM(str(ref), device="cpu", dtype="float32").score(PROMPTS)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), "gpt-oss from GGUF differs from its safetensors"
        assert got == _greedy(str(ref))
        return
    model = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32, attn_implementation="eager").eval()
    assert got == [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS], f"{arch}: greedy tokens differ"


def test_qwen3moe_matches_transformers_gguf_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers reads the same file with its own GGUF code (tensor names, dequantisation). Its
    config comes from the original config.json, every layer MoE: transformers' qwen3moe GGUF mapping
    reads no expert FFN size (expert_feed_forward_length) and places no dense layer's tensors."""
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    monkeypatch.setitem(tiny_models.CONFIGS, "qwen3_moe", {**tiny_models.CONFIGS["qwen3_moe"], "mlp_only_layers": []})
    path, _ = _build(tmp_path, "qwen3_moe", T.F16, T.Q8_0)
    config = AutoConfig.from_pretrained(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                 dtype=torch.float32, attn_implementation="eager").eval()
    assert _greedy(str(path)) == [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


def test_mxfp4_repack_is_bit_exact() -> None:
    """ggml MXFP4 blocks -> ferryman mxfp4 banks: the same values as gguf-py's dequantiser, bit for bit."""
    from gguf import dequantize

    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (3, 5, 4 * 17), dtype=torch.uint8, generator=g)
    raw.view(3, 5, 4, 17)[..., 0] = torch.randint(100, 150, (3, 5, 4), dtype=torch.uint8, generator=g)
    want = torch.from_numpy(dequantize(raw.numpy(), T.MXFP4))  # [3, 5, 128]
    blocks, scales = ggml_mxfp4_to_blocks_scales(raw)
    assert torch.equal(dequant_mxfp4(blocks, scales, torch.float32), want)


def _mixed_layers(tmp: Path) -> Path:
    """gpt-oss with layer 0's experts in F32 and the others MXFP4: one format per layer."""
    def type_of(name: str, shape: tuple[int, ...]) -> T:
        if "_exps.weight" in name:
            return T.F32 if name.startswith("blk.0.") else T.MXFP4
        return T.F32
    build_tiny("gpt_oss", tmp / "hf")
    (tmp / "gguf").mkdir()
    write_gguf(tmp / "hf", "gpt_oss", tmp / "gguf" / "m.gguf", type_of)
    return tmp / "gguf" / "m.gguf"


def test_per_layer_formats_offload_equals_resident(tmp_path: Path) -> None:
    """Layers of different formats: resident and offloaded (a few slots, each as wide as the widest
    layer's expert; a layer's copy moves its own row bytes) give the same tokens."""
    path = _mixed_layers(tmp_path)
    resident = LLM(str(path), device="cpu", dtype="float32")
    cfg = resident.engine.cfg
    assert cfg.expert_formats == ("dense", "mxfp4", "mxfp4")
    stores = resident.engine.runner.experts.store.formats
    assert [stores[i].name for i in cfg.moe_layers] == ["dense", "mxfp4", "mxfp4"]
    want = [o.token_ids for o in resident.generate(prompt_token_ids=PROMPTS, params=GREEDY)]
    off = LLM(str(path), device="cpu", dtype="float32", moe_strategy="offload", expert_cache=5)
    cache = off.engine.runner.experts.cache
    rows = {i: off.engine.runner.experts.cache.store.flat[i].shape[1] for i in cfg.moe_layers}
    assert rows[0] > rows[1] == rows[2] and cache.pool.layout.row_bytes == rows[0]
    got = [o.token_ids for o in off.generate(prompt_token_ids=PROMPTS, params=GREEDY)]
    assert got == want
    c = cache.counters  # every copy (a miss or a prefetch) moved its own layer's row, no more
    copied = {i: c.misses.get(i, 0) + c.prefetch_fetched.get(i, 0) for i in cfg.moe_layers}
    assert copied[1] > 0 and cache.transfer.bytes == sum(n * rows[i] for i, n in copied.items())


def test_split_files_and_folder(tmp_path: Path) -> None:
    """A split set loads from its first part or its folder; another part or a missing one is refused."""
    from ferryman.errors import ModelLoadError

    path, _ = _build(tmp_path, "olmoe", T.F16, T.Q8_0, split_tensors=12)
    parts = sorted(path.parent.glob("*.gguf"))
    assert len(parts) > 2 and parts[0].name == "m-00001-of-%05d.gguf" % len(parts)
    want = _greedy(str(parts[0]))
    assert _greedy(str(path.parent)) == want
    with pytest.raises(ModelLoadError, match="part 2 of a split GGUF model; pass the first part"):
        LLM(str(parts[1]), device="cpu")
    parts[-1].unlink()
    with pytest.raises(ModelLoadError, match=f"part {parts[-1].name} is missing"):
        LLM(str(parts[0]), device="cpu")


def _k_mix(name: str, shape: tuple[int, ...]) -> T:
    """A Q4_K_M-like mix: experts Q4_K with ffn_down Q6_K in layer 0 and Q5_K in layer 2 (a format per
    layer); the other matrices in the remaining K and IQ types."""
    if len(shape) == 1 or "ffn_gate_inp" in name:
        return T.F32
    if "_exps" in name:
        return (T.Q6_K if name.startswith("blk.0.") else T.Q5_K) if "down" in name else T.Q4_K
    table = {"attn_q.": T.Q2_K, "attn_k.": T.Q3_K, "attn_v.": T.IQ4_XS, "attn_output.": T.IQ4_NL,
             "ffn_gate.": T.Q5_K, "ffn_up.": T.Q4_K, "ffn_down.": T.Q6_K, "token_embd": T.Q6_K}
    return next((t for k, t in table.items() if k in name), T.Q8_0)


@pytest.fixture
def k_quant_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """qwen3moe 256 wide (K-quant blocks hold 256 values) in `_k_mix`: random valid blocks for the
    types gguf-py cannot quantise; the reference holds what gguf-py dequantises from them."""
    wide = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256)
    monkeypatch.setitem(tiny_models.CONFIGS, "qwen3_moe", {**tiny_models.CONFIGS["qwen3_moe"], **wide})
    build_tiny("qwen3_moe", tmp_path / "hf")
    (tmp_path / "gguf").mkdir()
    ref = write_gguf(tmp_path / "hf", "qwen3_moe", tmp_path / "gguf" / "m.gguf", _k_mix)
    return tmp_path / "gguf" / "m.gguf", write_reference(tmp_path / "hf", "qwen3_moe", ref, tmp_path / "ref")


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_k_quants_match_transformers_and_offload(k_quant_model: tuple[Path, Path], device: str) -> None:
    """On CUDA the experts stay in their blocks in the slots and the Triton kernels read them."""
    path, ref = k_quant_model
    llm = LLM(str(path), device=device, dtype="float32")
    assert llm.engine.cfg.expert_formats == ("gguf:q4_k:q6_k", "", "gguf:q4_k:q5_k")
    got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, params=GREEDY)]
    model = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32, attn_implementation="eager").eval()
    assert got == [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]
    off = LLM(str(path), device=device, dtype="float32", moe_strategy="offload", expert_cache=4)
    assert [o.token_ids for o in off.generate(prompt_token_ids=PROMPTS, params=GREEDY)] == got
    # the planner counts each layer's packed bytes: a slot holds the widest layer's expert
    from ferryman.planner import all_expert_bytes

    flat = off.engine.runner.experts.cache.store.flat
    assert off.engine.plan.slot_bytes == max(f.shape[1] for f in flat.values())
    assert all_expert_bytes(llm.engine.cfg, torch.float32) == sum(f.numel() for f in flat.values())


def test_iq4_nl_experts(tmp_path: Path) -> None:
    path, ref = _build(tmp_path, "olmoe", T.IQ4_NL, T.Q8_0)
    model = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32, attn_implementation="eager").eval()
    assert _greedy(str(path)) == [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.mark.parametrize("strategy", ["layers:2", "cpu"])
def test_per_layer_formats_on_the_cpu_strategies(tmp_path: Path, strategy: str) -> None:
    """The CPU computes each layer in that layer's own format (dense, then MXFP4): the same tokens as
    the resident run."""
    path = _mixed_layers(tmp_path)
    want = [o.token_ids for o in LLM(str(path), device="cpu", dtype="float32").generate(
        prompt_token_ids=PROMPTS, params=GREEDY)]
    llm = LLM(str(path), device="cpu", dtype="float32", moe_strategy=strategy, expert_cache=5)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, params=GREEDY)] == want
    assert llm.engine.runner.experts.cpu is not None and llm.engine.runner.experts.cpu.experts > 0
