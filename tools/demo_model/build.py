"""One entry point: corpus -> tokenizer -> training -> export -> held-out eval -> model card.

    python -m tools.demo_model.build --out ferryman/assets/demo-moe --minutes 8
    python -m tools.demo_model.build --out /tmp/demo --tiny     # smoke test, seconds on 2 CPU cores
    python -m tools.demo_model.build --out /tmp/chat --base ferryman/assets/demo-moe --chat-minutes 3.5 --device cuda
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer

from ferryman import LLM
from tools.demo_model.chat_stage import chat_stage, from_base
from tools.demo_model.chat_tune import ChatSpec, tiny_chat_spec
from tools.demo_model.card import LOSS_CURVE_FILE, plot_loss_curve, write_model_card
from tools.demo_model.config import EOS_TOKEN, BuildSpec, check_size, count_parameters, hf_config, real_spec, \
    tiny_spec, with_overrides
from tools.demo_model.corpus import SPLITS, corpus_stats, load_corpus
from tools.demo_model.evaluate import load_exported, next_token_loss
from tools.demo_model.export import export_model
from tools.demo_model.routing import fill_card
from tools.demo_model.routing import measure as measure_routing
from tools.demo_model.tokenizer import encode_stream, pack_windows, save_tokenizer, token_id, train_tokenizer
from tools.demo_model.train import TrainLog, build_model, train

CORPUS_STATS_FILE = "corpus_stats.json"
TRAINING_LOG_FILE = "training_log.json"
CHAT_DEFAULTS = ChatSpec()


class Progress:
    """Timestamped log lines (plain text, so they read well in CI and remote logs)."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[demo-model {time.monotonic() - self.start:7.1f}s] {message}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.demo_model.build", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="export folder (must be empty or absent)")
    parser.add_argument("--minutes", type=float, default=None, help="training wall-clock budget (default 8)")
    parser.add_argument("--tiny", action="store_true", help="tiny model, few steps, file subset (smoke test)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--experts-impl", default=None,
                        help="transformers experts_implementation (eager, grouped_mm, batched_mm); default theirs")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (compile time eats the budget)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-eval-windows", type=int, default=None)
    parser.add_argument("--chat-minutes", type=float, default=0.0,
                        help="then fine-tune on chat samples so the model ends its turns (0: no chat stage)")
    parser.add_argument("--chat-steps", type=int, default=CHAT_DEFAULTS.max_steps, help="chat fine-tune step limit")
    parser.add_argument("--chat-lr", type=float, default=CHAT_DEFAULTS.lr, help="chat fine-tune peak learning rate")
    parser.add_argument("--chat-layers", type=int, default=CHAT_DEFAULTS.train_layers,
                        help="0: every weight learns; N: only the last N decoder layers (cheaper on CPU)")
    parser.add_argument("--chat-step-tokens", type=int, default=CHAT_DEFAULTS.step_tokens,
                        help="tokens per chat fine-tune batch, padding included")
    parser.add_argument("--chat-long-share", type=float, default=CHAT_DEFAULTS.long_share,
                        help="share of chat steps whose conversations open with a 4k-16k-token system message")
    parser.add_argument("--chat-eval-prompts", type=int, default=CHAT_DEFAULTS.eval_prompts,
                        help="held-out prompts of each kind (short, long system message) for the turn-ending figure")
    parser.add_argument("--base", type=Path, default=None,
                        help="skip the build: run only the chat stage on this exported model folder "
                             "(with --tiny: few steps on short samples, a smoke test)")
    return parser.parse_args(argv)


def make_spec(args: argparse.Namespace) -> BuildSpec:
    spec = tiny_spec() if args.tiny else real_spec()
    return with_overrides(spec, minutes=args.minutes, batch_size=args.batch_size, lr=args.lr,
                          max_steps=args.max_steps, seed=args.seed, max_eval_windows=args.max_eval_windows)


def prepare_out(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output folder {out} is not empty; give a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def train_summary(result: TrainLog, device: torch.device, train_tokens: int) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    return {
        "device": name, "device_type": device.type, "steps": result.steps, "tokens": result.tokens,
        "seconds": round(result.seconds, 3), "stopped_by": result.stopped_by,
        "epochs": result.tokens / max(train_tokens, 1),
        "final_loss": result.rows[-1]["loss"] if result.rows else math.nan,
        "best_step": result.best_step, "best_val_loss": result.best_val_loss, "restored_best": result.restored_best,
        "torch": torch.__version__, "transformers": transformers.__version__,
    }


def prepare_data(spec: BuildSpec, out: Path, log: Progress) -> tuple[Tokenizer, dict[str, torch.Tensor], dict]:
    """Corpus, tokenizer (trained on the training split) and [W, T] windows of each split."""
    corpus = load_corpus(spec.corpus)
    log(f"corpus: { {k: len(v) for k, v in corpus.splits.items()} } files from {corpus.root} ({corpus.counts})")
    tokenizer = train_tokenizer(corpus.texts("train"), spec.model.vocab_size)
    if tokenizer.get_vocab_size() > spec.model.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, model only {spec.model.vocab_size}")
    streams = {split: encode_stream(tokenizer, corpus.texts(split)) for split in SPLITS}
    tokens = {split: len(stream) for split, stream in streams.items()}
    log(f"tokenizer: {tokenizer.get_vocab_size()} tokens; tokens per split {tokens}")
    stats = corpus_stats(corpus, spec.corpus, tokens)
    write_json(out / CORPUS_STATS_FILE, stats)
    t = spec.train
    limits = {"train": None, "val": t.max_val_windows, "heldout": t.max_eval_windows}
    windows = {split: pack_windows(streams[split], t.seq_len, limits[split]) for split in SPLITS}
    return tokenizer, windows, stats


def build(args: argparse.Namespace, log: Progress) -> dict:
    """Run the whole pipeline into args.out; returns the training log record."""
    spec = make_spec(args)
    prepare_out(args.out)
    device = pick_device(args.device)
    tokenizer, windows, stats = prepare_data(spec, args.out, log)
    eos = token_id(tokenizer, EOS_TOKEN)
    config = hf_config(spec.model, eos)
    params = count_parameters(config)
    log(f"model: {params:,} parameters, ~{check_size(config) / 2**20:.2f} MiB bf16 safetensors")
    model = build_model(config, spec.train.seed, args.experts_impl)
    log(f"training on {device} for up to {spec.train.minutes:g} min / {spec.train.max_steps} steps, "
        f"{len(windows['train']):,} windows of {spec.train.seq_len}")
    result = train(model, windows["train"], spec.train, device, log, windows["val"], compile_model=args.compile)

    save_tokenizer(tokenizer, args.out, spec.model.served_context)
    weights_bytes = export_model(model, args.out, [eos, token_id(tokenizer, "<|im_end|>")], spec.model)
    log(f"exported {weights_bytes / 2**20:.2f} MiB of bf16 weights to {args.out}")
    ev = next_token_loss(load_exported(args.out, device), windows["heldout"], spec.train.eval_batch_size, device)
    log(f"held-out loss {ev['loss']:.4f} over {ev['windows']} windows of {ev['seq_len']} tokens")

    summary = train_summary(result, device, windows["train"].numel())
    record = {"spec": spec.to_json(), "train": summary, "eval": ev, "log": result.rows, "val_log": result.val_rows}
    write_json(args.out / TRAINING_LOG_FILE, record)
    has_plot = plot_loss_curve(result.rows, result.val_rows, ev["loss"], args.out / LOSS_CURVE_FILE)
    if not has_plot:
        log("matplotlib is not installed: no loss curve image")
    command = "python -m tools.demo_model.build --out ferryman/assets/demo-moe --minutes 8"
    write_model_card(args.out, spec, stats, summary, ev, params, weights_bytes, has_plot, command)
    routing = measure_routing(LLM(str(args.out), device=str(device), dtype="float32"),
                              max_tokens=spec.routing_tokens, window=min(512, spec.train.seq_len))
    fill_card(args.out, routing)
    log(f"routing: LRU 10/25/50% of experts hits {routing['mean']['lru_10']:.1%} / "
        f"{routing['mean']['lru_25']:.1%} / {routing['mean']['lru_50']:.1%} on {routing['tokens']} held-out tokens")
    if args.chat_minutes > 0:
        chat_stage(load_exported(args.out, torch.device("cpu")), tokenizer, args.out, args.out, chat_spec(args),
                   spec.model, device, log, spec.corpus)
    log(f"done: {sorted(p.name for p in args.out.iterdir())}")
    return record


def chat_spec(args: argparse.Namespace) -> ChatSpec:
    spec = ChatSpec(minutes=args.chat_minutes, max_steps=args.chat_steps, lr=args.chat_lr,
                    train_layers=args.chat_layers, step_tokens=args.chat_step_tokens, long_share=args.chat_long_share,
                    eval_prompts=args.chat_eval_prompts)
    return tiny_chat_spec(spec) if args.tiny else spec


def pick_device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.base is not None:
        if args.chat_minutes <= 0:
            raise SystemExit("--base runs only the chat stage: give --chat-minutes too")
        corpus = tiny_spec().corpus if args.tiny else None
        from_base(args.base, args.out, chat_spec(args), pick_device(args.device), Progress(), corpus)
        return 0
    build(args, Progress())
    return 0


if __name__ == "__main__":
    sys.exit(main())
