"""Chat fine-tune: teach the trained model to end its turns with `<|im_end|>`.

A short, seeded run from the trained (or shipped) weights: each step mixes chat samples
(chat_data.py; loss on the assistant's code and its `<|im_end|>` only) with plain code windows of
the training split (loss on every token), so completion quality holds. Constant learning rate
after a linear warm-up, fp32 (it runs on CPU), stops at max_steps or the wall-clock budget.
Then `turn_end_rate` measures, through ferryman, how often the model ends its turn on held-out
chat prompts.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from ferryman import LLM, SamplingParams
from tools.demo_model.chat_data import IGNORE, ChatSample, chat_samples, collate
from tools.demo_model.config import TrainSpec
from tools.demo_model.train import Log, TrainLog, make_optimizer, seed_everything


@dataclass(frozen=True, slots=True)
class ChatSpec:
    """The chat fine-tune stage; minutes == 0 turns it off."""

    minutes: float = 0.0
    max_steps: int = 200
    chat_rows: int = 8  # chat samples per step
    plain_rows: int = 2  # plain code windows per step
    seq_len: int = 192  # longest chat sample and length of a plain window
    train_layers: int = 4  # only the last this many decoder layers learn (the rest, embedding included, frozen)
    lr: float = 3e-4
    warmup_steps: int = 20
    seed: int = 4321
    log_every: int = 10
    eval_prompts: int = 32  # held-out chat prompts for the turn-ending figure
    eval_max_tokens: int = 256  # "ends its turn within this many tokens"

    def __post_init__(self) -> None:
        if self.minutes < 0 or self.max_steps < 1 or self.chat_rows < 1 or self.plain_rows < 0:
            raise ValueError(f"bad chat fine-tune settings: {self}")

    @property
    def samples(self) -> int:
        return self.max_steps * self.chat_rows


def masked_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled positions (router aux loss left out: the
    routing the model learned stays as it is)."""
    # ids, labels: [B, T]
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # [B, T-1, V]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=IGNORE)


def step_batch(samples: list[ChatSample], plain: torch.Tensor, spec: ChatSpec, step: int,
               rng: random.Random, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chat samples of this step, then `plain_rows` random plain windows, right-padded together."""
    # plain: [W, seq_len] int64
    chat = samples[(step * spec.chat_rows) % len(samples):][:spec.chat_rows]
    ids, labels = collate(chat, pad_id)  # [C, Tc]
    if spec.plain_rows == 0:
        return ids, labels
    rows = plain[[rng.randrange(len(plain)) for _ in range(spec.plain_rows)]]  # [P, seq_len]
    width = max(ids.size(1), rows.size(1))
    ids = F.pad(ids, (0, width - ids.size(1)), value=pad_id)
    labels = F.pad(labels, (0, width - labels.size(1)), value=IGNORE)
    rows_ids = F.pad(rows, (0, width - rows.size(1)), value=pad_id)
    rows_labels = F.pad(rows, (0, width - rows.size(1)), value=IGNORE)
    return torch.cat([ids, rows_ids]), torch.cat([labels, rows_labels])


def freeze_all_but_last(model: torch.nn.Module, layers: int) -> None:
    """Only the last `layers` decoder layers keep requires_grad: backward stops there, which makes
    a CPU step several times cheaper; the tied embedding / output head stays as trained."""
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers[-layers:]:
        for p in layer.parameters():
            p.requires_grad_(True)
    for p in model.model.norm.parameters():
        p.requires_grad_(True)


def tune(model: torch.nn.Module, samples: list[ChatSample], plain: torch.Tensor, spec: ChatSpec,
         pad_id: int, device: torch.device, log: Log) -> TrainLog:
    """Fine-tune in place (fp32) until max_steps or the budget."""
    seed_everything(spec.seed)
    rng = random.Random(spec.seed)
    model.to(device, torch.float32).train()
    freeze_all_but_last(model, spec.train_layers)
    optimizer = make_optimizer(model, _optimizer_spec(spec), device)
    result, total = TrainLog(), 0.0
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        if result.steps >= spec.max_steps or elapsed >= spec.minutes * 60:
            result.stopped_by = "max_steps" if result.steps >= spec.max_steps else "time_budget"
            break
        lr = spec.lr * min(1.0, (result.steps + 1) / spec.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, labels = step_batch(samples, plain, spec, result.steps, rng, pad_id)
        ids, labels = ids.to(device), labels.to(device)
        loss = masked_loss(model, ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result.steps += 1
        result.tokens += int((labels != IGNORE).sum())
        total += loss.item()
        if result.steps % spec.log_every == 0:
            row = {"step": result.steps, "tokens": result.tokens, "lr": lr, "loss": total / spec.log_every,
                   "elapsed_s": round(time.monotonic() - start, 3)}
            result.rows.append(row)
            log(f"chat step {row['step']:>4}  loss {row['loss']:.4f}  lr {lr:.1e}  {row['elapsed_s']:.0f} s")
            total = 0.0
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    result.seconds = time.monotonic() - start
    log(f"chat fine-tune stopped by {result.stopped_by} after {result.steps} steps, {result.seconds:.0f} s")
    return result


def _optimizer_spec(spec: ChatSpec) -> TrainSpec:
    """No weight decay: a short fine-tune should not shrink the trained weights."""
    return TrainSpec(lr=spec.lr, weight_decay=0.0)


def eval_prompts(tokenizer: Tokenizer, texts: list[str], spec: ChatSpec, end_id: int) -> list[list[int]]:
    """Held-out chat prompts (rendered with the generation prompt), built as the training samples are."""
    samples = chat_samples(tokenizer, texts, spec.seed + 7, spec.seq_len, end_id, spec.eval_prompts)
    return [s.ids[:s.prompt_len] for s in samples]


def turn_end_rate(folder: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy generation through ferryman: the share of prompts whose answer ends with a stop
    token (`<|im_end|>` or `<|endoftext|>`) within max_tokens, and the answers' mean length."""
    llm = LLM(str(folder), device="cpu", dtype="float32")
    outs = llm.generate(prompt_token_ids=prompts, params=SamplingParams(temperature=0.0, max_tokens=max_tokens))
    ended = [o for o in outs if o.finish_reason == "stop"]
    lengths = [len(o.token_ids) for o in ended]
    return {"prompts": len(prompts), "ended": len(ended), "share": len(ended) / max(len(prompts), 1),
            "max_tokens": max_tokens, "mean_tokens_when_ended": sum(lengths) / max(len(lengths), 1)}
