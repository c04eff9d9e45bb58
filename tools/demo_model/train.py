"""Plain torch training loop for the demo model.

AdamW, linear warmup x cosine decay, bf16 autocast on CUDA, router load-balancing loss, and a
wall-clock budget: the cosine runs on progress = max(step / max_steps, elapsed / budget), so the
learning rate reaches its floor exactly when the budget (or the step limit) runs out.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tools.demo_model.config import TrainSpec
from tools.demo_model.evaluate import next_token_loss

Log = Callable[[str], None]


@dataclass(slots=True)
class TrainLog:
    """What the loop measured; rows are written every `log_every` steps."""

    rows: list[dict] = field(default_factory=list)
    val_rows: list[dict] = field(default_factory=list)  # every `val_every` steps and at the end
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    stopped_by: str = ""
    best_step: int = 0
    best_val_loss: float = math.inf
    restored_best: bool = False


class BestWeights:
    """Validation loss every `val_every` steps; keeps a copy of the weights with the lowest one.

    The corpus is small (a few million tokens on a stripped-down stdlib), so a long budget means
    many epochs; exporting the best-validation weights guards against overfitting.
    """

    def __init__(self, model: torch.nn.Module, windows: torch.Tensor, batch_size: int, device: torch.device) -> None:
        self.model, self.windows, self.batch_size, self.device = model, windows, batch_size, device
        self.state: dict[str, torch.Tensor] | None = None

    def check(self, result: TrainLog, log: Log) -> None:
        loss = next_token_loss(self.model, self.windows, self.batch_size, self.device)["loss"]
        result.val_rows.append({"step": result.steps, "tokens": result.tokens, "val_loss": loss})
        if loss < result.best_val_loss:
            result.best_val_loss, result.best_step = loss, result.steps
            self.state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        log(f"step {result.steps:>6}  validation loss {loss:.4f}  (best {result.best_val_loss:.4f} "
            f"at step {result.best_step})")

    def restore(self, result: TrainLog, log: Log) -> None:
        if self.state is not None and result.best_step != result.steps:
            self.model.load_state_dict(self.state)
            result.restored_best = True
            log(f"restored the weights of step {result.best_step} (lowest validation loss)")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_model(config: Qwen3MoeConfig, seed: int, experts_impl: str | None) -> Qwen3MoeForCausalLM:
    """Fresh fp32 model with deterministic init (master weights stay fp32; autocast does bf16)."""
    seed_everything(seed)
    kwargs = {} if experts_impl is None else {"experts_implementation": experts_impl}
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32, **kwargs)


def lr_at(spec: TrainSpec, step: int, progress: float) -> float:
    """Linear warmup over `warmup_steps` times cosine decay from lr to lr*min_lr_ratio on `progress`."""
    warm = min(1.0, (step + 1) / max(1, spec.warmup_steps))
    floor = spec.lr * spec.min_lr_ratio
    cosine = floor + 0.5 * (spec.lr - floor) * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return warm * cosine


def next_lr(optimizer: torch.optim.Optimizer, spec: TrainSpec, max_steps: int, result: "TrainLog", start: float,
            budget_s: float) -> float | None:
    """The learning rate of the next step, set on every param group (`lr_at` on the larger of the
    step share and the time share); None once either runs out, with result.stopped_by saying which."""
    progress = max(result.steps / max_steps, (time.monotonic() - start) / budget_s)
    if progress >= 1.0:
        result.stopped_by = "max_steps" if result.steps >= max_steps else "time_budget"
        return None
    lr = lr_at(spec, result.steps, progress)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def stop_clock(result: "TrainLog", device: torch.device, start: float) -> None:
    """result.seconds: the wall time since `start`, once the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result.seconds = time.monotonic() - start


def make_optimizer(model: torch.nn.Module, spec: TrainSpec, device: torch.device) -> torch.optim.AdamW:
    """Weight decay on matrices (embeddings, projections, experts, routers), none on norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": spec.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, fused=device.type == "cuda")


def batch_order(num_windows: int, seed: int, epoch: int) -> torch.Tensor:
    """A fresh, seeded permutation of the training windows for each epoch."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_windows, generator=gen)


def batches(windows: torch.Tensor, batch_size: int, seed: int):
    """Endless stream of [B, T] batches over shuffled epochs (a last partial batch is dropped)."""
    if len(windows) < batch_size:
        raise ValueError(f"{len(windows)} training windows cannot fill a batch of {batch_size}")
    epoch = 0
    while True:
        order = batch_order(len(windows), seed, epoch)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield windows[order[start:start + batch_size]]
        epoch += 1


def step_losses(
    model: Qwen3MoeForCausalLM, ids: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy (mean over B*(T-1) predictions) and the router aux loss."""
    # ids: [B, T]
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = model(input_ids=ids, output_router_logits=True, use_cache=False)
    logits = out.logits[:, :-1].float()  # [B, T-1, V]
    lm_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    return lm_loss, out.aux_loss.float()


def train(
    model: Qwen3MoeForCausalLM,
    windows: torch.Tensor,
    spec: TrainSpec,
    device: torch.device,
    log: Log,
    val_windows: torch.Tensor,
    compile_model: bool = False,
) -> TrainLog:
    """Train in place until max_steps or the wall-clock budget, ending with the best-validation weights."""
    # windows: [W, T] int64 training windows; val_windows: [V, T]
    model.to(device).train()
    best = BestWeights(model, val_windows, spec.eval_batch_size, device)
    forward = torch.compile(model) if compile_model else model
    optimizer = make_optimizer(model, spec, device)
    data = batches(windows.to(device), spec.batch_size, spec.seed)
    budget_s = spec.minutes * 60.0
    coef = model.config.router_aux_loss_coef
    result = TrainLog()
    sums = torch.zeros(2, device=device)  # running (lm, aux) loss since the last log row
    lr = 0.0
    start = time.monotonic()
    while (step_lr := next_lr(optimizer, spec, spec.max_steps, result, start, budget_s)) is not None:
        lr = step_lr
        ids = next(data)
        lm_loss, aux_loss = step_losses(forward, ids, device)
        (lm_loss + coef * aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sums += torch.stack([lm_loss.detach(), aux_loss.detach()])
        result.steps += 1
        result.tokens += ids.numel()
        if result.steps % spec.log_every == 0:
            _log_row(result, sums, spec.log_every, lr, start, log)
            sums.zero_()
        if result.steps % spec.val_every == 0:
            best.check(result, log)
    if result.steps % spec.log_every:
        _log_row(result, sums, result.steps % spec.log_every, lr, start, log)  # the last partial interval
    if result.steps % spec.val_every:
        best.check(result, log)
    best.restore(result, log)
    stop_clock(result, device, start)
    log(f"training stopped by {result.stopped_by} after {result.steps} steps, "
        f"{result.tokens:,} tokens, {result.seconds:.1f} s ({result.tokens / result.seconds:,.0f} tok/s)")
    return result


def _log_row(result: TrainLog, sums: torch.Tensor, n: int, lr: float, start: float, log: Log) -> None:
    lm, aux = (sums / n).tolist()  # one host sync per log row
    elapsed = time.monotonic() - start
    row = {"step": result.steps, "tokens": result.tokens, "lr": lr, "loss": lm, "aux_loss": aux,
           "elapsed_s": round(elapsed, 3), "tokens_per_s": round(result.tokens / max(elapsed, 1e-9), 1)}
    result.rows.append(row)
    log(f"step {row['step']:>6}  loss {lm:.4f}  aux {aux:.4f}  lr {lr:.2e}  "
        f"{row['tokens_per_s']:,.0f} tok/s  {elapsed:.0f} s")
