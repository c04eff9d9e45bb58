"""The chat stage of the build: fine-tune, then measure held-out loss and turn endings before and after.

Runs at the end of a full build (`--chat-minutes`), or on an exported model (`--base FOLDER`):
the folder is copied, its weights fine-tuned and re-exported, its card and training log extended.
"""

from __future__ import annotations

import json
import platform
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tools.demo_model.card import put_card_section
from tools.demo_model.chat_data import chat_samples
from tools.demo_model.chat_tune import ChatSpec, eval_prompts, tune, turn_end_rate
from tools.demo_model.config import CorpusSpec, ModelSpec
from tools.demo_model.corpus import load_corpus
from tools.demo_model.evaluate import load_exported, next_token_loss
from tools.demo_model.export import WEIGHTS_FILE, export_model
from tools.demo_model.tokenizer import encode_stream, pack_windows, token_id
from tools.demo_model.train import Log

CARD_MARK = "## Chat turns"
EVAL_WINDOWS = 32  # held-out windows of EVAL_LEN tokens for the before / after loss
EVAL_LEN = 512


def measure(folder: Path, heldout: torch.Tensor, prompts: list[list[int]], spec: ChatSpec) -> dict:
    """Held-out loss (transformers, fp32, CPU) and the turn-ending share (ferryman) of an exported folder."""
    loss = next_token_loss(load_exported(folder, torch.device("cpu")), heldout, 8, torch.device("cpu"))
    return {"heldout": loss, "turns": turn_end_rate(folder, prompts, spec.eval_max_tokens)}


def _row(name: str, m: dict | None) -> str:
    if m is None:
        return f"| {name} | not measured | | |"
    t = m["turns"]
    mean = f"{t['mean_tokens_when_ended']:.0f}" if t["ended"] else "-"
    return f"| {name} | {t['ended']}/{t['prompts']} ({t['share']:.0%}) | {mean} | {m['heldout']['loss']:.4f} |"


def card_section(record: dict) -> str:
    s, a, t = record["spec"], record["after"], record["train"]
    return (
        f"The pre-trained model only completed code and never ended a chat turn. A chat fine-tune "
        f"(`tools/demo_model/chat_tune.py`, seed {s['seed']}) then ran {t['steps']} steps in {t['seconds']:.0f} s on "
        f"{record['device']}: each step {s['chat_rows']} chat samples rendered with the model's ChatML template "
        f"(user: a function's docstring or signature, or a file's first lines, 30% after a system message; "
        f"assistant: the code, then `<|im_end|>`; loss on the assistant's tokens only) and {s['plain_rows']} plain "
        f"code windows, all of at most {s['seq_len']} tokens, from the training files; AdamW at {s['lr']:g} after "
        f"{s['warmup_steps']} warm-up steps, only the last {s['train_layers']} layers and the final norm learning.\n\n"
        f"Measured on {record['python']}'s standard library, held-out split: {a['turns']['prompts']} chat prompts "
        f"built like the training samples, answered greedily through ferryman; the loss on "
        f"{a['heldout']['windows']} windows of {a['heldout']['seq_len']} tokens (transformers, fp32).\n\n"
        f"| | ends its turn within {s['eval_max_tokens']} tokens | mean answer tokens when it ends | held-out loss |\n"
        f"| --- | --- | --- | --- |\n"
        f"{_row('before the chat fine-tune', record['before'])}\n{_row('shipped', a)}\n"
    )


def fill_card(folder: Path, record: dict) -> None:
    """Insert (or replace) the card's chat section, just before its "## Context" or "## Limits"."""
    put_card_section(folder / "README.md", CARD_MARK, card_section(record), before=("## Context", "## Limits"))


def chat_stage(model: torch.nn.Module, tokenizer: Tokenizer, before: Path, out: Path, spec: ChatSpec,
               model_spec: ModelSpec, device: torch.device, log: Log) -> dict:
    """Fine-tune `model` (whose export is the folder `before`), export it into `out`, then measure
    both; the record goes into out's training_log.json ("chat") and card."""
    if before.resolve() == out.resolve():  # a full build: keep the pre-chat export to measure it
        before = Path(shutil.copytree(before, Path(tempfile.mkdtemp()) / "before"))
    corpus = load_corpus(CorpusSpec())
    end_id, eos = token_id(tokenizer, "<|im_end|>"), token_id(tokenizer, "<|endoftext|>")
    heldout = pack_windows(encode_stream(tokenizer, corpus.texts("heldout")), EVAL_LEN, EVAL_WINDOWS)
    prompts = eval_prompts(tokenizer, corpus.texts("heldout"), spec, end_id)
    samples = chat_samples(tokenizer, corpus.texts("train"), spec.seed, spec.seq_len, end_id, spec.samples)
    plain = pack_windows(encode_stream(tokenizer, corpus.texts("train")), spec.seq_len)
    log(f"chat fine-tune: {len(samples)} chat samples, {len(plain)} plain windows of {spec.seq_len}")
    result = tune(model, samples, plain, spec, eos, device, log)
    export_model(model, out, [eos, end_id], model_spec)
    record = {"spec": spec_json(spec), "device": _device_name(device), "python": corpus_python(),
              "train": {"steps": result.steps, "seconds": result.seconds, "stopped_by": result.stopped_by,
                        "tokens": result.tokens},
              "log": result.rows, "after": measure(out, heldout, prompts, spec), "before": None}
    log(f"after the chat fine-tune: {record['after']}")
    write_record(out, record)  # the shipped model's figures first: the base's are measured after
    record["before"] = measure(before, heldout, prompts, spec)
    log(f"before the chat fine-tune: {record['before']}")
    write_record(out, record)
    return record


def write_record(out: Path, record: dict) -> None:
    """The stage's record into out's training_log.json ("chat") and its card section."""
    log_file = out / "training_log.json"
    full = json.loads(log_file.read_text()) if log_file.exists() else {}
    log_file.write_text(json.dumps({**full, "chat": record}, indent=2) + "\n", encoding="utf-8")
    fill_card(out, record)


def from_base(base: Path, out: Path, spec: ChatSpec, log: Log) -> dict:
    """The chat stage on an exported model: copy `base` into `out` (weights re-exported after)."""
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output folder {out} is not empty; give a new or empty folder")
    if not (base / WEIGHTS_FILE).is_file():
        raise ValueError(f"--base {base} holds no {WEIGHTS_FILE}")
    shutil.copytree(base, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(WEIGHTS_FILE))
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    model = load_exported(base, torch.device("cpu"))
    model_spec = _model_spec(base)
    return chat_stage(model, tokenizer, base, out, spec, model_spec, torch.device("cpu"), log)


def _model_spec(folder: Path) -> ModelSpec:
    """The build's ModelSpec as recorded in the folder's training_log.json (the served RoPE comes from it)."""
    recorded = json.loads((folder / "training_log.json").read_text())["spec"]["model"]
    return ModelSpec(**recorded)


def spec_json(spec: ChatSpec) -> dict:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def corpus_python() -> str:
    return f"CPython {platform.python_version()}"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"
