"""Bad GGUF files and arguments get one clear line naming the file, tensor or field, never a
traceback; `ferryman info / run` on a GGUF file; its tokenizer and chat template from the metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from ferryman import LLM
from ferryman.cli import main
from ferryman.errors import ConfigError, ModelLoadError, UnsupportedModelError, WeightError
from gguf_models import byte_tokenizer, mixed, write_gguf
from tiny_models import build_tiny


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_moe")
    build_tiny("qwen3_moe", folder)
    return folder


@pytest.fixture(scope="module")
def good(hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "qwen.gguf"
    write_gguf(hf, "qwen3_moe", path, mixed(T.F16, T.Q8_0), extra=byte_tokenizer)
    return path


def test_wrong_magic_and_truncated(good: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + good.read_bytes()[4:1000])
    with pytest.raises(ModelLoadError, match=r"bad.gguf is not a GGUF file \(its first bytes are not 'GGUF'\)"):
        LLM(str(bad), device="cpu")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"cut.gguf is not a readable GGUF file .* may be truncated"):
        LLM(str(cut), device="cpu")


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    path = tmp_path / "bert.gguf"
    w = GGUFWriter(path, "bert")
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 4, 8), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedModelError, match="architecture 'bert' is not one ferryman runs; supported: "
                                                    "qwen3moe, llama, olmoe, gpt-oss, glm4moe"):
        LLM(str(path), device="cpu")


def test_unsupported_tensor_type_names_tensor(hf: Path, tmp_path: Path) -> None:
    def iq2(w: GGUFWriter) -> None:
        w.add_tensor("blk.0.extra.weight", np.zeros((4, 66), dtype=np.uint8), raw_dtype=T.IQ2_XXS)
    path = tmp_path / "iq2.gguf"
    write_gguf(hf, "qwen3_moe", path, extra=iq2)
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.0.extra.weight' has type IQ2_XXS, which ferryman does "
                                             r"not load \(supported: F32, F16, BF16, Q8_0"):
        LLM(str(path), device="cpu")


def test_shape_contradicting_metadata(hf: Path, tmp_path: Path) -> None:
    """Metadata saying 4 KV heads over tensors written for 2: the first tensor that disagrees is named."""
    lied = tmp_path / "hf"
    lied.mkdir()
    for f in hf.iterdir():
        (lied / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((lied / "config.json").read_text())
    (lied / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
    path = tmp_path / "lied.gguf"
    write_gguf(lied, "qwen3_moe", path)
    with pytest.raises(WeightError, match=r"weight 'blk.0.attn_k.weight' in .*lied.gguf: shape mismatch "
                                          r"\(expected shape \[64, 64\], got \[32, 64\]\)"):
        LLM(str(path), device="cpu")


def test_gate_and_up_of_different_types(hf: Path, tmp_path: Path) -> None:
    def type_of(name: str, shape: tuple[int, ...]) -> T:
        return T.F16 if "ffn_up_exps" in name else T.F32
    path = tmp_path / "mixed.gguf"
    write_gguf(hf, "qwen3_moe", path, type_of)
    with pytest.raises(ModelLoadError, match="layer 0's ffn_gate_exps is F32 but ffn_up_exps is F16"):
        LLM(str(path), device="cpu")


def test_folder_with_two_models_and_config_folder_misuse(good: Path, hf: Path, tmp_path: Path) -> None:
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(good.read_bytes())
    with pytest.raises(ModelLoadError, match="must hold exactly one GGUF model .* found a.gguf, b.gguf"):
        LLM(str(two), device="cpu")
    with pytest.raises(ConfigError, match="config_folder applies to GGUF models"):
        LLM(str(hf), device="cpu", config_folder=str(hf))


def test_cli_bad_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nothing here")
    assert main(["info", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "x.gguf is not a GGUF file" in err[0], err


def test_cli_info_and_run(good: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["info", str(good)]) == 0
    out = capsys.readouterr().out
    assert "architecture: qwen3_moe" in out and "format dense" in out and str(good) in out
    assert main(["run", str(good), "--device", "cpu", "--dtype", "float32", "-p", "hello", "--max-tokens", "4"]) == 0


def test_tokenizer_and_chat_template_from_metadata(good: Path) -> None:
    """The tokenizer transformers converts from the metadata (offline), its chat template, its eos."""
    from transformers import AutoTokenizer

    llm = LLM(str(good), device="cpu", dtype="float32")
    ref = AutoTokenizer.from_pretrained(str(good.parent), gguf_file=good.name)
    text = "hello, ferryman\n"
    assert llm.encode(text) == list(ref.encode(text)) and len(llm.encode(text)) < len(text.encode())  # merges
    ids = llm.chat_ids([{"role": "user", "content": "hello"}])
    assert llm.tokenizer.decode(ids) == "<user>hello\n<assistant>"
    assert 10 in llm.engine.scheduler.eos_token_ids


def test_config_folder_overrides_metadata(good: Path, hf: Path) -> None:
    """config_folder's config.json replaces the metadata (its eos id here); no tokenizer files there:
    the file's own tokenizer stays."""
    cfg = json.loads((hf / "config.json").read_text())
    folder = good.parent / "override"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 77}))
    llm = LLM(str(good), device="cpu", dtype="float32", config_folder=str(folder))
    assert llm.engine.cfg.eos_token_ids == (77,) and llm.tokenizer is not None
