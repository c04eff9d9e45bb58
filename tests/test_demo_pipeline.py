"""The demo-model pipeline (tools/demo_model) end to end with --tiny, checked against transformers.

References we did not write: transformers (config/model/tokenizer loading, its own causal-LM
loss), safetensors, and the stdlib's own source files and `tokenize.detect_encoding`.
"""

from __future__ import annotations

import io
import json
import platform
import sys
import sysconfig
import tokenize
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tools` is not an installed package

from tools.demo_model import build  # noqa: E402
from tools.demo_model.config import MAX_SAFETENSORS_BYTES, ModelSpec, check_size, hf_config, real_spec  # noqa: E402
from tools.demo_model.train import BestWeights, TrainLog, lr_at  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Real stdlib files with CRLF line ends, odd encodings or much non-ASCII text (skipped where absent).
TRICKY_FILES = ("lib2to3/tests/data/crlf.py", "test/tokenizedata/coding20731.py", "test/test_unicode_identifiers.py",
                "test/test_codecs.py", "encodings/cp1252.py")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "demo-moe"
    # 10 steps: one validation (val_every=10), a best step and a loss curve, as with the preset's 30
    assert build.main(["--out", str(out), "--tiny", "--device", "cpu", "--max-steps", "10"]) == 0
    return out


def read_source(relpath: str) -> str:
    data = (STDLIB / relpath).read_bytes()
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode("utf-8" if encoding == "utf-8-sig" else encoding)


def test_export_loads_offline_with_transformers(exported: Path) -> None:
    config = AutoConfig.from_pretrained(exported, local_files_only=True)
    assert config.model_type == "qwen3_moe" and config.norm_topk_prob and config.tie_word_embeddings
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.dtype == torch.bfloat16
    raw = json.loads((exported / "config.json").read_text())
    assert raw["torch_dtype"] == raw["dtype"] == "bfloat16" and raw["rope_theta"] == 10000.0
    assert raw["num_experts"] == raw["num_local_experts"] == config.num_experts
    # the served context: YaRN x16 over the built-for positions, as transformers reads it
    spec = build.make_spec(build.parse_args(["--out", str(exported), "--tiny"])).model
    assert raw["max_position_embeddings"] == 16 * spec.max_position_embeddings == spec.served_context
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 16
    assert config.rope_parameters["original_max_position_embeddings"] == spec.max_position_embeddings
    assert "YaRN (factor 16 over the 2048" in (exported / "README.md").read_text()
    with safe_open(str(exported / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert {f.get_slice(n).get_dtype() for n in names} == {"BF16"}
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names and "lm_head.weight" not in names
    tok = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == config.eos_token_id
    gen = GenerationConfig.from_pretrained(exported, local_files_only=True)
    assert gen.do_sample is False
    assert gen.eos_token_id == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]


def test_heldout_loss_matches_transformers(exported: Path) -> None:
    """Rebuild the held-out slice with transformers' tokenizer and let transformers compute the loss."""
    record = json.loads((exported / build.TRAINING_LOG_FILE).read_text())
    stats = json.loads((exported / build.CORPUS_STATS_FILE).read_text())
    assert stats["python_version"] == platform.python_version()
    tok = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    stream: list[int] = []
    for relpath in stats["heldout_files"]:
        stream += tok(read_source(relpath), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(stream) == stats["tokens"]["heldout"]
    seq_len, windows = record["eval"]["seq_len"], record["eval"]["windows"]
    ids = torch.tensor(stream[: seq_len * windows]).view(windows, seq_len)
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in ids]
    expected = sum(losses) / len(losses)
    assert record["eval"]["loss"] == pytest.approx(expected, rel=1e-3)


def test_tokenizer_round_trips_python_source(exported: Path) -> None:
    tok = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    stats = json.loads((exported / build.CORPUS_STATS_FILE).read_text())
    paths = stats["heldout_files"] + [p for p in TRICKY_FILES if (STDLIB / p).is_file()]
    texts = [read_source(p) for p in paths]
    texts.append("\ufeffdef f(x):\r\n\treturn 'ünïcødé ✓ 🐍'  \n\n\n    \x00\x7f\u2028 <|endoftext|>")
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text


def test_chat_template_and_model_card(exported: Path) -> None:
    tok = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    prompt = tok.apply_chat_template([{"role": "user", "content": "def add(a, b):"}],
                                     tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.convert_tokens_to_ids("<|im_end|>") in ids
    record = json.loads((exported / build.TRAINING_LOG_FILE).read_text())
    assert record["val_log"] and record["train"]["best_step"] in [r["step"] for r in record["val_log"]]
    card = (exported / "README.md").read_text()
    routing = card.split("## Routing statistics", 1)[1].split("\n## ", 1)[0]
    assert "TODO" not in routing and "| mean |" in routing  # measured through ferryman by the build
    assert "## Limits" in card  # the sections after it survive
    assert "Python Software Foundation License" in card and platform.python_version() in card
    assert (exported / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_real_preset_fits_and_oversize_is_refused() -> None:
    spec = real_spec().model
    config = hf_config(spec, eos_id=0)
    assert config.num_hidden_layers >= 8 and config.num_experts >= 32 and config.num_experts_per_tok == 4
    assert check_size(config) <= MAX_SAFETENSORS_BYTES
    big = hf_config(replace(spec, moe_intermediate_size=128), eos_id=0)
    with pytest.raises(ValueError, match="over the 40 MiB limit"):
        check_size(big)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelSpec(num_heads=8, num_kv_heads=3)


def test_lr_schedule_warms_up_then_decays_to_floor() -> None:
    spec = real_spec().train
    assert lr_at(spec, 0, 0.0) == pytest.approx(spec.lr / spec.warmup_steps)
    assert lr_at(spec, spec.warmup_steps, 0.0) == pytest.approx(spec.lr)
    assert lr_at(spec, 10**6, 0.5) == pytest.approx(spec.lr * (1 + spec.min_lr_ratio) / 2)
    assert lr_at(spec, 10**6, 1.0) == pytest.approx(spec.lr * spec.min_lr_ratio)


def test_best_weights_restores_the_lowest_validation_loss() -> None:
    config = hf_config(replace(real_spec().model, vocab_size=300, hidden_size=32, num_layers=1, num_heads=2,
                               num_kv_heads=1, head_dim=16, num_experts=4, moe_intermediate_size=32), eos_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    windows = torch.randint(0, 300, (4, 16))
    best, result, lines = BestWeights(model, windows, 2, torch.device("cpu")), TrainLog(), []
    best.check(result, lines.append)
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)  # much sharper, mostly wrong predictions: a worse validation loss
    result.steps = 1
    best.check(result, lines.append)
    assert result.val_rows[1]["val_loss"] > result.val_rows[0]["val_loss"] and result.best_step == 0
    best.restore(result, lines.append)
    assert result.restored_best
    assert all(torch.equal(v, kept[k]) for k, v in model.state_dict().items())
