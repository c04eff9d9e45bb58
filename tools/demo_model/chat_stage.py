"""The chat stage of the build: fine-tune, then measure held-out loss and turn endings before and after.

Runs at the end of a full build (`--chat-minutes`), or on an exported model (`--base FOLDER`):
the folder is copied, its weights fine-tuned and re-exported, its card and training log extended.
"""

from __future__ import annotations

import json
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tools.demo_model.card import put_card_section
from tools.demo_model.chat_eval import eval_prompts, turn_end_rates
from tools.demo_model.chat_mix import mixed_samples
from tools.demo_model.chat_tune import ChatSpec, Schedule, tune
from tools.demo_model.config import CorpusSpec, ModelSpec
from tools.demo_model.corpus import load_corpus
from tools.demo_model.evaluate import load_exported, next_token_loss
from tools.demo_model.export import WEIGHTS_FILE, export_model
from tools.demo_model.tokenizer import encode_stream, pack_windows, token_id
from tools.demo_model.train import Log

CARD_MARK = "## Chat turns"
EVAL_WINDOWS = 32  # held-out windows of EVAL_LEN tokens for the before / after loss
EVAL_LEN = 512
LIMITS_BULLET = "- It completes Python source code"
EVAL_SEED_OFFSET = 7  # the held-out prompts' seed is the training seed + this


@dataclass(frozen=True, slots=True)
class EvalSet:
    heldout: torch.Tensor  # [W, EVAL_LEN] windows of the held-out split
    prompts: dict[str, list[list[int]]]  # kind -> prompt token ids
    stop_ids: list[int]  # <|endoftext|>, <|im_end|>


def measure(folder: Path, ev: EvalSet, spec: ChatSpec, device: torch.device, log: Log) -> dict:
    """Held-out loss (transformers, fp32) and the turn-ending shares of an exported folder."""
    batch = 16 if device.type == "cuda" else 4
    loss = next_token_loss(load_exported(folder, device), ev.heldout, batch, device)
    turns = turn_end_rates(folder, ev.prompts, spec.eval_max_tokens, device, ev.stop_ids, log)
    return {"heldout": loss, "turns": turns}


def _cell(t: dict) -> str:
    return f"{t['ended']}/{t['prompts']} ({t['share']:.0%})"


def _row(name: str, m: dict | None) -> str:
    if m is None:
        return f"| {name} | not measured | | | |"
    t = m["turns"]
    ended = [x for x in (t["short"], t["long_system"]) if x["ended"]]
    mean = sum(x["mean_tokens_when_ended"] * x["ended"] for x in ended) / max(1, sum(x["ended"] for x in ended))
    return f"| {name} | {_cell(t['short'])} | {_cell(t['long_system'])} | {mean:.0f} | {m['heldout']['loss']:.4f} |"


def card_section(record: dict) -> str:
    s, a, t, m = record["spec"], record["after"], record["train"], record["spec"]["mix"]
    n = s["train_layers"]
    layers = "every weight" if n == 0 else f"only the last {n} layers and the final norm"
    long_t = a["turns"]["long_system"]
    return (
        f"A chat fine-tune teaches the model, a code completer, to end its turns. It "
        f"(`tools/demo_model/chat_tune.py`, seed {s['seed']}) ran from the weights of the table's first row: "
        f"{t['steps']} steps in {t['seconds']:.0f} s on "
        f"{record['device']}, {layers} learning: AdamW at {s['lr']:g} (cosine to {s['min_lr_ratio']:g} of it), batches "
        f"of up to {s['step_tokens']} tokens of conversations rendered with the model's ChatML template, loss on the "
        f"assistant's messages and their `<|im_end|>` only. The conversations come from the training files "
        f"(`tools/demo_model/chat_mix.py`): code requests (a function's docstring or signature, or a file's first "
        f"lines; the answer is the code), short prose answers, and tool use (a `<tool_call>`, a `<tool_response>` "
        f"turn, a summary), in one to three exchanges. {s['long_share']:.0%} of the steps are conversations that "
        f"open with an agent-like system message of {m['long_min']}-{m['long_max']} tokens (markdown instructions, "
        f"environment, source files and tools as JSON schemas in the `# Tools` block `ferryman serve` writes); the "
        f"other steps hold conversations of at most {m['short_len']} tokens and {s['plain_rows']} plain code windows "
        f"of {s['plain_len']} tokens (loss on every token, so completion holds).\n\n"
        f"Measured on {record['python']}'s standard library, held-out split: chat prompts built like the training "
        f"conversations (the long ones {long_t['prompt_tokens'][0]}-{long_t['prompt_tokens'][1]} tokens), answered "
        f"greedily through {a['turns']['engine']}; the loss on {a['heldout']['windows']} windows of "
        f"{a['heldout']['seq_len']} tokens (transformers, fp32).\n\n"
        f"| | short prompts ending within {s['eval_max_tokens']} tokens | long-system-message prompts ending | "
        f"mean answer tokens when it ends | held-out loss |\n"
        f"| --- | --- | --- | --- | --- |\n"
        f"{_row('before the chat fine-tune', record['before'])}\n{_row('shipped', a)}\n"
    )


def limits_line(record: dict) -> str:
    """The card's first "Limits" bullet, with the stage's figures."""
    a, b = record["after"], record["before"]
    t = a["turns"]
    loss = f"held-out loss {a['heldout']['loss']:.2f}" + (f" (before: {b['heldout']['loss']:.2f})" if b else "")
    return (f"- It completes Python source code and does not follow instructions. The chat stage taught it to end "
            f"its answers with `<|im_end|>` ({t['short']['share']:.0%} of held-out short chat prompts and "
            f"{t['long_system']['share']:.0%} of prompts after a long agent-like system message end within "
            f"{t['short']['max_tokens']} tokens, \"Chat turns\"); {loss} on {a['heldout']['windows']} windows.")


def fill_card(folder: Path, record: dict) -> None:
    """Insert (or replace) the card's chat section, just before its "## Context" or "## Limits",
    and rewrite the first "Limits" bullet with the stage's figures."""
    card = folder / "README.md"
    put_card_section(card, CARD_MARK, card_section(record), before=("## Context", "## Limits"))
    lines = [limits_line(record) if line.startswith(LIMITS_BULLET) else line
             for line in card.read_text(encoding="utf-8").split("\n")]
    card.write_text("\n".join(lines), encoding="utf-8")


def check_context(model: torch.nn.Module, longest: int, log: Log) -> None:
    """The config's positions (YaRN over the trained ones) must cover the longest sample or prompt."""
    config = model.config
    positions = config.max_position_embeddings
    log(f"context: max_position_embeddings {positions}, rope {getattr(config, 'rope_parameters', None)}; "
        f"longest sample or prompt + answer {longest} tokens")
    if longest > positions:
        raise ValueError(f"a chat sample of {longest} tokens does not fit the model's max_position_embeddings "
                         f"{positions}: lower the long system message size")


def chat_stage(model: torch.nn.Module, tokenizer: Tokenizer, before: Path, out: Path, spec: ChatSpec,
               model_spec: ModelSpec, device: torch.device, log: Log, corpus_spec: CorpusSpec | None = None) -> dict:
    """Fine-tune `model` (whose export is the folder `before`), export it into `out`, then measure
    both; the record goes into out's training_log.json ("chat") and card."""
    start = time.monotonic()
    if before.resolve() == out.resolve():  # a full build: keep the pre-chat export to measure it
        before = Path(shutil.copytree(before, Path(tempfile.mkdtemp()) / "before"))
    corpus = load_corpus(corpus_spec or CorpusSpec())
    end_id, eos = token_id(tokenizer, "<|im_end|>"), token_id(tokenizer, "<|endoftext|>")
    held, train = corpus.splits["heldout"], corpus.splits["train"]
    ev = EvalSet(pack_windows(encode_stream(tokenizer, [f.text for f in held]), EVAL_LEN, EVAL_WINDOWS),
                 eval_prompts(tokenizer, [f.text for f in held], [f.relpath for f in held], spec.mix,
                              spec.seed + EVAL_SEED_OFFSET, end_id, spec.eval_prompts), [eos, end_id])
    short, long = mixed_samples(tokenizer, [f.text for f in train], [f.relpath for f in train], spec.mix, spec.seed,
                                end_id, spec.short_pool, spec.long_pool)
    plain = pack_windows(encode_stream(tokenizer, [f.text for f in train]), spec.plain_len)
    prompts = [p for kind in ev.prompts.values() for p in kind]
    check_context(model, max([len(s.ids) for s in short + long] + [len(p) + spec.eval_max_tokens for p in prompts]),
                  log)
    log(f"chat fine-tune: {len(short)} short and {len(long)} long conversations, {len(plain)} plain windows of "
        f"{spec.plain_len}; eval prompts { {k: len(v) for k, v in ev.prompts.items()} }")
    schedule = Schedule(short, long, plain, spec, eos)
    budget_s = spec.minutes * 60 - (time.monotonic() - start)
    log(f"chat data ready in {time.monotonic() - start:.0f} s; {budget_s:.0f} s left to train")
    if budget_s <= 0:
        raise ValueError(f"preparing the chat data took {time.monotonic() - start:.0f} s, the whole "
                         f"--chat-minutes {spec.minutes:g} budget: give more minutes or smaller pools")
    result = tune(model, schedule, spec, device, log, budget_s)
    export_model(model, out, [eos, end_id], model_spec)
    record = {"spec": spec.to_json(), "device": _device_name(device), "python": corpus_python(),
              "train": {"steps": result.steps, "seconds": result.seconds, "stopped_by": result.stopped_by,
                        "tokens": result.tokens},
              "log": result.rows, "after": measure(out, ev, spec, device, log), "before": None}
    log(f"after the chat fine-tune: {_brief(record['after'])}")
    write_record(out, record)  # the shipped model's figures first: the base's are measured after
    record["before"] = measure(before, ev, spec, device, log)
    log(f"before the chat fine-tune: {_brief(record['before'])}")
    write_record(out, record)
    return record


def _brief(m: dict) -> str:
    t = m["turns"]
    return (f"short {_cell(t['short'])}, long system {_cell(t['long_system'])} ended ({t['engine']}), "
            f"held-out loss {m['heldout']['loss']:.4f}")


def write_record(out: Path, record: dict) -> None:
    """The stage's record into out's training_log.json ("chat") and its card section."""
    log_file = out / "training_log.json"
    full = json.loads(log_file.read_text()) if log_file.exists() else {}
    log_file.write_text(json.dumps({**full, "chat": record}, indent=2) + "\n", encoding="utf-8")
    fill_card(out, record)


def from_base(base: Path, out: Path, spec: ChatSpec, device: torch.device, log: Log,
              corpus_spec: CorpusSpec | None = None) -> dict:
    """The chat stage on an exported model: copy `base` into `out` (weights re-exported after)."""
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output folder {out} is not empty; give a new or empty folder")
    if not (base / WEIGHTS_FILE).is_file():
        raise ValueError(f"--base {base} holds no {WEIGHTS_FILE}")
    shutil.copytree(base, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(WEIGHTS_FILE))
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    model = load_exported(base, torch.device("cpu"))
    model_spec = _model_spec(base)
    return chat_stage(model, tokenizer, base, out, spec, model_spec, device, log, corpus_spec)


def _model_spec(folder: Path) -> ModelSpec:
    """The build's ModelSpec as recorded in the folder's training_log.json (the served RoPE comes from it)."""
    recorded = json.loads((folder / "training_log.json").read_text())["spec"]["model"]
    return ModelSpec(**recorded)


def corpus_python() -> str:
    return f"CPython {platform.python_version()}"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"
