"""Chat fine-tune: teach the trained model to end its turns with `<|im_end|>`.

A seeded run from the trained (or shipped) weights. Each step is one batch of conversations
(chat_mix.py; loss on the assistant messages and their `<|im_end|>` only): either short ones
(with `plain_rows` plain code windows of the training split, loss on every token, so completion
quality holds) or, with probability `long_share`, conversations that open with an agent-like
system message of 4k-16k tokens. Batches hold up to `step_tokens` tokens, padding included;
samples of similar length are batched together. AdamW, linear warm-up then cosine decay to
`min_lr_ratio` of the peak on max(step / max_steps, elapsed / budget), bf16 autocast on CUDA
(fp32 master weights), all layers learning unless `train_layers` says otherwise.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F

from tools.demo_model.chat_data import IGNORE, ChatSample, collate
from tools.demo_model.chat_mix import MixSpec
from tools.demo_model.config import TrainSpec
from tools.demo_model.train import Log, TrainLog, make_optimizer, next_lr, seed_everything, stop_clock


@dataclass(frozen=True, slots=True)
class ChatSpec:
    """The chat fine-tune stage; minutes == 0 turns it off."""

    minutes: float = 0.0  # wall-clock budget of data preparation and training (the measurements come after)
    max_steps: int = 100_000
    step_tokens: int = 32_768  # tokens per batch, padding included
    max_rows: int = 128  # conversations per batch at most
    long_share: float = 0.35  # share of steps whose batch holds long-system-message conversations
    plain_rows: int = 8  # plain code windows added to each short batch
    plain_len: int = 512
    short_pool: int = 12_000  # conversations generated (cycled when training runs longer)
    long_pool: int = 600
    train_layers: int = 0  # 0: every weight learns; N: only the last N decoder layers and the final norm
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    seed: int = 4321
    log_every: int = 50
    eval_prompts: int = 48  # held-out prompts of each kind (short, long system message)
    eval_max_tokens: int = 256  # "ends its turn within this many tokens"
    mix: MixSpec = field(default_factory=MixSpec)

    def __post_init__(self) -> None:
        if self.minutes < 0 or self.max_steps < 1 or self.step_tokens < self.mix.short_len or self.plain_rows < 0:
            raise ValueError(f"bad chat fine-tune settings: {self}")
        if not 0 <= self.long_share <= 1 or self.train_layers < 0 or self.eval_prompts < 1:
            raise ValueError(f"bad chat fine-tune settings: {self}")

    def to_json(self) -> dict:
        return asdict(self)


def tiny_chat_spec(spec: ChatSpec) -> ChatSpec:
    """Short samples, few steps, few prompts: the whole stage in well under a minute on 2 CPU cores."""
    mix = MixSpec(short_len=384, long_min=768, long_max=1536)
    return replace(spec, max_steps=min(spec.max_steps, 6), step_tokens=2048, max_rows=8, plain_rows=2,
                   plain_len=128, short_pool=48, long_pool=8, log_every=2, warmup_steps=2, eval_prompts=3,
                   eval_max_tokens=32, mix=mix)


def length_batches(samples: list[ChatSample], step_tokens: int, max_rows: int, rng: random.Random) -> list[list[int]]:
    """Indices of samples grouped into batches of similar length, rows x longest <= step_tokens."""
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].ids), i))
    batches, current, width = [], [], 0
    for i in order:
        w = max(width, len(samples[i].ids))
        if current and ((len(current) + 1) * w > step_tokens or len(current) == max_rows):
            batches.append(current)
            current, w = [], len(samples[i].ids)
        current.append(i)
        width = w
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


class Schedule:
    """The endless sequence of [B, T] (ids, labels) step batches: short or long, cycled."""

    def __init__(self, short: list[ChatSample], long: list[ChatSample], plain: torch.Tensor, spec: ChatSpec,
                 pad_id: int) -> None:
        # plain: [W, plain_len] int64
        self.rng = random.Random(spec.seed)
        self.short, self.long, self.plain, self.spec, self.pad_id = short, long, plain, spec, pad_id
        self.short_batches = length_batches(short, spec.step_tokens, spec.max_rows, self.rng)
        self.long_batches = length_batches(long, spec.step_tokens, spec.max_rows, self.rng) if long else []
        self.taken = {"short": 0, "long": 0}

    def next(self) -> tuple[torch.Tensor, torch.Tensor, str]:
        kind = "long" if self.long_batches and self.rng.random() < self.spec.long_share else "short"
        batches, samples = (self.long_batches, self.long) if kind == "long" else (self.short_batches, self.short)
        picked = [samples[i] for i in batches[self.taken[kind] % len(batches)]]
        self.taken[kind] += 1
        ids, labels = collate(picked, self.pad_id)  # [C, Tc]
        if kind == "short" and self.spec.plain_rows:
            ids, labels = self._with_plain(ids, labels)
        return ids, labels, kind

    def _with_plain(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.plain[[self.rng.randrange(len(self.plain)) for _ in range(self.spec.plain_rows)]]  # [P, L]
        width = max(ids.size(1), rows.size(1))
        pad = lambda t, value: F.pad(t, (0, width - t.size(1)), value=value)  # noqa: E731
        return (torch.cat([pad(ids, self.pad_id), pad(rows, self.pad_id)]),
                torch.cat([pad(labels, IGNORE), pad(rows, IGNORE)]))


def masked_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled positions; the output head runs only there
    (router aux loss left out: the routing the model learned stays as it is)."""
    # ids, labels: [B, T]
    targets = labels[:, 1:]  # [B, T-1]
    keep = targets != IGNORE
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]  # [B, T-1, D]
        logits = model.lm_head(hidden[keep])  # [N, V]
    return F.cross_entropy(logits.float(), targets[keep])


def set_trainable(model: torch.nn.Module, layers: int) -> None:
    """layers == 0: every weight learns. Otherwise only the last `layers` decoder layers and the
    final norm (backward stops there, which makes a CPU step several times cheaper)."""
    for p in model.parameters():
        p.requires_grad_(layers == 0)
    if layers == 0:
        return
    for layer in model.model.layers[-layers:]:
        for p in layer.parameters():
            p.requires_grad_(True)
    for p in model.model.norm.parameters():
        p.requires_grad_(True)


def tune(model: torch.nn.Module, schedule: Schedule, spec: ChatSpec, device: torch.device, log: Log,
         budget_s: float) -> TrainLog:
    """Fine-tune in place (fp32 master weights) until max_steps or budget_s seconds."""
    seed_everything(spec.seed)
    model.to(device, torch.float32).train()
    set_trainable(model, spec.train_layers)
    opt_spec = TrainSpec(lr=spec.lr, weight_decay=0.0, warmup_steps=spec.warmup_steps, min_lr_ratio=spec.min_lr_ratio)
    optimizer = make_optimizer(model, opt_spec, device)  # no weight decay: do not shrink the trained weights
    result = TrainLog()
    sums = {"short": torch.zeros(2, device=device), "long": torch.zeros(2, device=device)}  # (loss sum, steps)
    start = time.monotonic()
    while (lr := next_lr(optimizer, opt_spec, spec.max_steps, result, start, budget_s)) is not None:
        ids, labels, kind = schedule.next()
        ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = masked_loss(model, ids, labels, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sums[kind] += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        result.steps += 1
        result.tokens += ids.numel()
        if result.steps % spec.log_every == 0:
            _log_row(result, sums, lr, start, log)
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    stop_clock(result, device, start)
    log(f"chat fine-tune stopped by {result.stopped_by} after {result.steps} steps ({schedule.taken}), "
        f"{result.tokens:,} tokens, {result.seconds:.0f} s")
    return result


def _log_row(result: TrainLog, sums: dict[str, torch.Tensor], lr: float, start: float, log: Log) -> None:
    means = {k: (v[0] / v[1]).item() if v[1] > 0 else None for k, v in sums.items()}  # one sync per row
    row = {"step": result.steps, "tokens": result.tokens, "lr": lr, "loss_short": means["short"],
           "loss_long": means["long"], "elapsed_s": round(time.monotonic() - start, 3)}
    result.rows.append(row)
    shown = "  ".join(f"{k} {v:.4f}" for k, v in means.items() if v is not None)
    log(f"chat step {row['step']:>5}  loss {shown}  lr {lr:.1e}  {row['elapsed_s']:.0f} s")
    for v in sums.values():
        v.zero_()
