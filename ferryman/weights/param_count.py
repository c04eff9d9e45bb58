"""Parameter counts of a MoE model from its HF config alone (no weights).

`total` counts every tensor of the checkpoint (embedding and lm_head included, biases, norms,
gpt-oss sinks). `active` counts what one token touches: everything except the routed experts,
plus top-k routed experts per MoE layer. Publishers differ on `active`: Mistral and Qwen count
the embedding table (Mixtral 12.9B, Qwen3-30B-A3B 3.3B), OpenAI does not (gpt-oss-20b 3.6B =
our active minus vocab_size * hidden_size).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ferryman.errors import UnsupportedModelError
from ferryman.models.summary import summarize


class ParamCount(NamedTuple):
    total: int
    active: int


def count_params(cfg: dict[str, Any]) -> ParamCount:
    """(total, active) parameter counts of the model `cfg` (an HF config.json dict) describes."""
    try:
        s = summarize(cfg)
    except UnsupportedModelError as e:
        raise ValueError(f"count_params: {e}") from None
    return ParamCount(s.total_params, s.active_params)
