"""Held-out loss of the exported model, computed the way transformers defines it.

The number in the model card is measured on what ships: the bf16 weights are loaded back from the
export folder, upcast to fp32 and run without autocast. The loss is the mean next-token
cross-entropy over every prediction of every window: each [T]-token window gives T-1 predictions,
all windows have the same length, so this equals the mean over windows of
`model(input_ids=w, labels=w).loss` in transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel


def load_exported(folder: Path, device: torch.device) -> PreTrainedModel:
    """The exported model in fp32 (weights are the bf16 values, exactly)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    return model.to(device).eval()


@torch.no_grad()
def next_token_loss(model: PreTrainedModel, windows: torch.Tensor, batch_size: int, device: torch.device) -> dict:
    """Mean next-token cross-entropy over all windows; windows: [W, T] int64."""
    if windows.dim() != 2 or windows.size(1) < 2:
        raise ValueError(f"held-out windows must be [W, T>=2], got {tuple(windows.shape)}")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, len(windows), batch_size):
        ids = windows[start:start + batch_size].to(device)  # [B, T]
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # [B, T-1, V]
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="sum")
        total += nll.double()
    predictions = windows.size(0) * (windows.size(1) - 1)
    return {
        "loss": (total / predictions).item(),
        "windows": windows.size(0),
        "seq_len": windows.size(1),
        "predictions": predictions,
    }
