"""Request fields checked before anything runs: text that is Unicode, stop strings within the
server's limits, and OpenAI's `logit_bias` (token id as text -> bias in [-100, 100]) turned into a
logits processor.

A bad value is a 400 naming the field (logged by the error handler), never silently ignored:
thousands of stop strings slow every step of the request, and a bias on a token id outside the
vocabulary would index past the logits.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import BaseModel

from ferryman.server.errors import APIError
from ferryman.server.state import ServerConfig

BIAS_LIMIT = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # only a lone surrogate cannot be encoded
        return False
    return True


_PLAIN = (int, float, type(None))  # what holds no text (token ids, numbers, bools): skipped


def _children(value: Any, path: str) -> list[tuple[Any, str]]:
    if isinstance(value, BaseModel):
        fields = type(value).model_fields
        return [(v, f"{path}.{fields[k].alias or k}" if path else fields[k].alias or k)
                for k, v in value.__dict__.items() if k in fields and not isinstance(v, _PLAIN)]
    if isinstance(value, dict):
        keyed = [(v, f"{path}.{k}" if path else str(k)) for k, v in value.items() if not isinstance(v, _PLAIN)]
        return keyed + [(k, path or "body") for k in value if isinstance(k, str)]
    if isinstance(value, list):
        texty = [i for i, v in enumerate(value) if not isinstance(v, _PLAIN)]  # token ids are not
        return [(value[i], f"{path}[{i}]") for i in texty]
    return []


def check_unicode(body: BaseModel) -> None:
    """A 400 naming the first string of the request that holds a lone surrogate: JSON lets a
    client write "\\ud800", no tokenizer takes it. An explicit stack: deep nesting cannot overflow."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and not _is_unicode(value):
                raise APIError(400, f"{path} holds a lone UTF-16 surrogate, which is not Unicode text", path)
        else:
            stack.extend(reversed(_children(value, path)))


def check_stops(stops: list[str], cfg: ServerConfig, param: str) -> list[str]:
    """`stops`, or a 400 naming `param` when there are more than the server takes."""
    if len(stops) > cfg.max_stop_strings:
        raise APIError(400, f"{param} has {len(stops)} stop strings; this server takes at most "
                            f"{cfg.max_stop_strings}", param)
    size = sum(len(s.encode("utf-8", "surrogatepass")) for s in stops)
    if size > cfg.max_stop_bytes:
        raise APIError(400, f"{param} holds {size} bytes of stop strings; this server takes at most "
                            f"{cfg.max_stop_bytes}", param)
    return stops


class LogitBias:
    """A `LogitsProcessor` adding a fixed bias to some tokens' logits (stateless: choices share it)."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = torch.tensor(list(bias), dtype=torch.long)  # [B]
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)  # [B]

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] -> [V], logits[ids] + values."""
        if self.ids.device != logits.device:
            self.ids, self.values = self.ids.to(logits.device), self.values.to(logits.device)
        return logits.index_add(0, self.ids, self.values.to(logits.dtype))


def _token_id(key: str) -> int:
    text = key.strip()
    if not (text.isascii() and text.isdigit()):  # also refuses signs: token ids are >= 0
        raise APIError(400, f"logit_bias keys must be token ids (integers as text), got {key!r}", "logit_bias")
    return int(text)


def _bias(key: str, value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or abs(value) > BIAS_LIMIT:
        raise APIError(400, f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {key}",
                       "logit_bias")
    return float(value)


def logit_bias(raw: dict[str, Any] | None, vocab_size: int) -> list[LogitBias]:
    """The request's logit_bias as logits processors (none when absent or empty), or a 400."""
    if not raw:
        return []
    bias: dict[int, float] = {}
    for key, value in raw.items():
        token = _token_id(key)
        if token >= vocab_size:
            raise APIError(400, f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})",
                           "logit_bias")
        bias[token] = _bias(key, value)
    return [LogitBias(bias)]
