"""Quantised checkpoints end to end: tiny qwen3_moe and mixtral written in each FP8 / NVFP4 layout
give the greedy tokens transformers gives on the same weights dequantised to fp32 (CPU, fp32);
`quantization_config` dispatch; dummy weights in these formats; bad input as one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from ferryman import LLM, SamplingParams
from ferryman.errors import ConfigError, WeightError
from ferryman.models.registry import model_config
from ferryman.quant.hf_quant import DUMMY_CONFIGS, is_ignored, quant_from_hf
from quant_checkpoints import LAYOUTS, quantise_folder
from tiny_models import build_tiny, hf_greedy

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33))]
CASES = [(a, lay) for a in ("qwen3_moe", "mixtral") for lay in LAYOUTS if a == "qwen3_moe" or lay != "ct_fp8_block"]


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for arch in ("qwen3_moe", "mixtral"):
        out[arch] = tmp_path_factory.mktemp(arch)
        build_tiny(arch, out[arch])
    return out


def _quantised(tiny_folders: dict[str, Path], tmp_path: Path, arch: str, layout: str) -> tuple[Path, Path]:
    q, ref = tmp_path / "q", tmp_path / "ref"
    shutil.copytree(tiny_folders[arch], q)
    quantise_folder(q, layout, ref)
    return q, ref


@pytest.mark.parametrize("arch,layout", CASES)
def test_greedy_tokens_match_transformers_on_dequantised_weights(tiny_folders, tmp_path: Path, arch: str,
                                                                  layout: str) -> None:
    q, ref_folder = _quantised(tiny_folders, tmp_path, arch, layout)
    ref = AutoModelForCausalLM.from_pretrained(ref_folder, attn_implementation="eager", dtype=torch.float32).eval()
    llm = LLM(str(q), device="cpu", dtype="float32")
    assert llm.engine.cfg.quant is not None and llm.engine.cfg.expert_format != "dense"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for ids, out in zip(PROMPTS, llm.generate(prompt_token_ids=PROMPTS, params=params)):
        assert out.token_ids == hf_greedy(ref, ids, 16), f"{arch} {layout}: greedy tokens differ"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["fp8_block", "fp8_tensor", "modelopt_nvfp4", "ct_nvfp4"])
def test_gpu_greedy_tokens_match_transformers(tiny_folders, tmp_path: Path, layout: str) -> None:
    """On CUDA: fp8:channel and nvfp4 decode through the Triton GEMV, fp8 16x16 blocks through the
    batched path's dequantiser; prompts prefill on the batched path."""
    q, ref_folder = _quantised(tiny_folders, tmp_path, "qwen3_moe", layout)
    ref = AutoModelForCausalLM.from_pretrained(ref_folder, attn_implementation="eager", dtype=torch.float32).eval()
    llm = LLM(str(q), device="cuda", dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for ids, out in zip(PROMPTS, llm.generate(prompt_token_ids=PROMPTS, params=params)):
        assert out.token_ids == hf_greedy(ref, ids, 16), f"cuda {layout}: greedy tokens differ"


def test_offloaded_quantised_experts_give_the_resident_tokens(tiny_folders, tmp_path: Path) -> None:
    """Packed experts through the host store and a 3-slot cache (copies, rounds of misses)."""
    q, _ = _quantised(tiny_folders, tmp_path, "qwen3_moe", "modelopt_nvfp4")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = LLM(str(q), device="cpu", dtype="float32").generate(prompt_token_ids=PROMPTS, params=params)
    off = LLM(str(q), device="cpu", dtype="float32", moe_strategy="offload", expert_cache=3)
    assert off.engine.plan.strategy == "offload"
    got = off.generate(prompt_token_ids=PROMPTS, params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_readers_pick_formats() -> None:
    def quant(qc: dict) -> tuple[str, str]:
        got = quant_from_hf({"model_type": "qwen3_moe", "quantization_config": qc})
        assert got is not None
        return got.format, got.linear

    assert quant(DUMMY_CONFIGS["fp8"]) == ("fp8:128x128", "fp8:block-128x128:weight_scale_inv")
    assert quant({"quant_method": "fp8"}) == ("fp8:channel", "fp8:tensor:weight_scale_inv")
    assert quant(DUMMY_CONFIGS["nvfp4"]) == ("nvfp4", "nvfp4:modelopt")
    nested = {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}
    assert quant(nested) == ("nvfp4", "nvfp4:modelopt")
    ct = quant_from_hf({"quantization_config": {"quant_method": "compressed-tensors", "ignore": ["re:.*mlp.gate$"],
                        "config_groups": {"g": {"format": "nvfp4-pack-quantized",
                                                "weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}})
    assert ct is not None and ct.format == "nvfp4-ct" and is_ignored("model.layers.3.mlp.gate", ct.ignore)
    assert not is_ignored("model.layers.3.mlp.gate_proj", ct.ignore)
    # transformers' should_convert_module: a prefix up to a module boundary, or a suffix
    fp8 = quant_from_hf({"quantization_config": {"quant_method": "fp8",
                                                 "modules_to_not_convert": ["model.layers.1", "mlp.gate"]}})
    assert fp8 is not None and is_ignored("model.layers.1.self_attn.q_proj", fp8.ignore)
    assert not is_ignored("model.layers.11.self_attn.q_proj", fp8.ignore)
    assert is_ignored("model.layers.3.mlp.gate", fp8.ignore) and not is_ignored("model.layers.3.mlp.gate_proj", fp8.ignore)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "bitsandbytes"}, "unsupported quantization_config.quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {}}, "scheme 'marlin-24'"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "scheme 'W4A8_AWQ'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive ints"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3"),
])
def test_unknown_schemes_are_one_line_errors(qc: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        quant_from_hf({"model_type": "qwen3_moe", "quantization_config": qc})
    assert "\n" not in str(e.value)


def test_block_format_refuses_an_ffn_it_cannot_stack() -> None:
    hf = json.loads((Path(__file__).parent.parent / "ferryman/assets/presets/qwen3-30b-a3b.json").read_text())
    hf.update(moe_intermediate_size=96, quantization_config=DUMMY_CONFIGS["fp8"])
    with pytest.raises(ConfigError, match="multiple of 128"):
        model_config(hf)


def _rewrite(folder: Path, edit) -> None:  # noqa: ANN001
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_scales_contradicting_weights_name_the_tensor(tiny_folders, tmp_path: Path) -> None:
    q, _ = _quantised(tiny_folders, tmp_path, "qwen3_moe", "fp8_block")
    name = "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"
    _rewrite(q, lambda t: t.__setitem__(name, torch.ones(3, 4)))
    with pytest.raises(WeightError, match=r"up_proj\.weight_scale_inv.*expected shape \[2, 4\], got \[3, 4\]"):
        LLM(str(q), device="cpu", dtype="float32")


def test_an_unquantised_expert_among_fp8_ones_names_the_tensor(tiny_folders, tmp_path: Path) -> None:
    q, _ = _quantised(tiny_folders, tmp_path, "qwen3_moe", "ct_fp8_channel")
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    _rewrite(q, lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(WeightError, match=r"experts\.5\.down_proj\.weight.*float32, expected torch.float8_e4m3fn"):
        LLM(str(q), device="cpu", dtype="float32")


def test_layers_a_release_left_unquantised_load_as_they_are(tiny_folders, tmp_path: Path) -> None:
    """A Linear stored without its scales (a release's `targets` left it out) is read as a plain weight;
    a routed expert so stored among fp8 ones is an error naming it."""
    q, ref_folder = _quantised(tiny_folders, tmp_path, "qwen3_moe", "ct_fp8_channel")
    plain = load_file(str(next(ref_folder.glob("*.safetensors"))))
    name = "model.layers.1.self_attn.o_proj.weight"

    def unquantise(t: dict) -> None:
        t[name] = plain[name]
        del t[name.replace("weight", "weight_scale")]

    _rewrite(q, unquantise)
    ref = AutoModelForCausalLM.from_pretrained(ref_folder, attn_implementation="eager", dtype=torch.float32).eval()
    out = LLM(str(q), device="cpu", dtype="float32").generate(
        prompt_token_ids=PROMPTS[:1], params=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(ref, PROMPTS[0], 8)
    expert = "model.layers.2.mlp.experts.4.gate_proj.weight"

    def unquantise_expert(t: dict) -> None:
        t[expert] = plain[expert]
        del t[expert.replace("weight", "weight_scale")]

    _rewrite(q, unquantise_expert)
    with pytest.raises(WeightError, match=r"experts\.4\.gate_proj\.weight.*stored without weight_scale"):
        LLM(str(q), device="cpu", dtype="float32")


def test_an_ignore_list_naming_an_expert_is_refused(tiny_folders, tmp_path: Path) -> None:
    q, _ = _quantised(tiny_folders, tmp_path, "qwen3_moe", "ct_nvfp4")
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("re:.*experts\\.1\\.")
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightError, match=r"experts\.1\.gate_proj\.weight.*one expert format"):
        LLM(str(q), device="cpu", dtype="float32")


def test_modelopt_export_reads_hf_quant_config(tiny_folders, tmp_path: Path) -> None:
    q, _ = _quantised(tiny_folders, tmp_path, "mixtral", "modelopt_nvfp4")
    cfg = json.loads((q / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (q / "config.json").write_text(json.dumps(cfg))
    (q / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": qc}))
    llm = LLM(str(q), device="cpu", dtype="float32")
    assert llm.engine.cfg.expert_format == "nvfp4"


@pytest.mark.parametrize("quantization,fmt", [("nvfp4", "nvfp4"), ("fp8", "fp8:128x128")])
def test_dummy_weights_in_quantised_formats(tmp_path: Path, quantization: str, fmt: str) -> None:
    cfg = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 128, "intermediate_size": 256,
           "torch_dtype": "float32", "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy", quantization=quantization, seed=3)
    assert llm.engine.cfg.expert_format == fmt
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], params=SamplingParams(temperature=0.0, max_tokens=4,
                                                                           ignore_eos=True))
    assert len(out[0].token_ids) == 4
    with pytest.raises(ConfigError, match="needs --load-format dummy"):
        LLM(str(tmp_path), device="cpu", quantization=quantization)


def test_checkpoint_config_wins_or_conflicts(tiny_folders, tmp_path: Path) -> None:
    q, _ = _quantised(tiny_folders, tmp_path, "qwen3_moe", "fp8_tensor")
    assert LLM(str(q), device="cpu", quantization="fp8").engine.cfg.expert_format == "fp8:channel"
    with pytest.raises(ConfigError, match="--quantization nvfp4 conflicts with the model's own quantization_config"):
        LLM(str(q), device="cpu", quantization="nvfp4")
