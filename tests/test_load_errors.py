"""Bad model folders and inputs get one clear error naming the thing that is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferryman import LLM, SamplingParams
from ferryman.cli import main
from ferryman.errors import ConfigError, FerrymanError, ModelLoadError, PromptTooLongError, UnsupportedModelError, WeightError
from tiny_models import build_tiny


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_moe")
    build_tiny("qwen3_moe", folder)
    return folder


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_folder_and_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ConfigError, match="no config.json"):
        LLM(str(tmp_path), device="cpu")


def test_unsupported_model_type_lists_supported(qwen: Path, tmp_path: Path) -> None:
    bad = _copy(qwen, tmp_path / "m")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "llama4_text"
    (bad / "config.json").write_text(json.dumps(cfg))
    supported = ".*gpt_oss, .*qwen3_5_moe, qwen3_5_moe_text, qwen3_moe, qwen3_next"
    with pytest.raises(UnsupportedModelError, match=f"llama4_text.*supported: {supported}"):
        LLM(str(bad), device="cpu")


def test_unsupported_quantization(qwen: Path, tmp_path: Path) -> None:
    bad = _copy(qwen, tmp_path / "m")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="quant_method 'bitsandbytes'"):
        LLM(str(bad), device="cpu")


def test_quantization_config_contradicting_the_tensors_names_a_tensor(qwen: Path, tmp_path: Path) -> None:
    """A supported method whose tensors are not in its layout: an error naming a tensor, no KeyError."""
    bad = _copy(qwen, tmp_path / "m")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                                  "desc_act": False}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FerrymanError, match="weight '.*'|tensor"):
        LLM(str(bad), device="cpu")


def test_missing_tensor_names_tensor_and_file(qwen: Path, tmp_path: Path) -> None:
    bad = _copy(qwen, tmp_path / "m")
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(WeightError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight.*model\.safetensors.*missing"):
        LLM(str(bad), device="cpu")


def test_wrong_shape_gives_expected_and_actual(qwen: Path, tmp_path: Path) -> None:
    bad = _copy(qwen, tmp_path / "m")
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(WeightError, match=r"k_proj.*expected shape \[32, 64\], got \[16, 64\]"):
        LLM(str(bad), device="cpu")


def test_sharded_checkpoint_loads_identically(qwen: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((qwen / "config.json").read_text())
    tensors = load_file(str(qwen / "model.safetensors"))
    names = sorted(tensors)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / fname))
        weight_map.update({k: fname for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = [[3, 9, 27, 81]]
    a = LLM(str(qwen), device="cpu", dtype="float32").score(ids)[0]
    b = LLM(str(sharded), device="cpu", dtype="float32").score(ids)[0]
    assert torch.equal(a, b)


def test_prompt_longer_than_context(qwen: Path) -> None:
    llm = LLM(str(qwen), device="cpu", max_model_len=32)
    with pytest.raises(PromptTooLongError, match="40.*32"):
        llm.generate(prompt_token_ids=[list(range(40))], params=SamplingParams(max_tokens=2))


def test_text_prompt_without_tokenizer(qwen: Path) -> None:
    llm = LLM(str(qwen), device="cpu")
    with pytest.raises(ConfigError, match="no tokenizer"):
        llm.generate(["hello"])


def test_cli_errors_are_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["run", str(tmp_path / "missing"), "-p", "x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ferryman: error:") and "does not exist" in err[0]
    assert main(["info", "gpt-oss-20b"]) == 0  # presets need no weights for info
    out = capsys.readouterr().out
    assert "20.915 B total" in out and "mxfp4" in out
    assert main(["run", "gpt-oss-20b", "--device", "cpu"]) == 2
    assert "--load-format dummy" in capsys.readouterr().err
