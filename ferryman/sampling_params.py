"""Per-request sampling parameters (OpenAI / vLLM names and semantics)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ferryman.errors import InvalidParameterError

if TYPE_CHECKING:
    import torch

# Below this temperature a request is decoded greedily: dividing fp32 logits by a smaller
# number overflows, and the distribution is a point mass anyway.
GREEDY_TEMPERATURE = 1e-5

# torch.Generator.manual_seed accepts any value in [-2**63, 2**64).
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class LogitsProcessor(Protocol):
    """Changes one sequence's next-token logits before sampling (a grammar's mask, a bias).

    Called in the engine thread each time the sequence samples, with its output tokens so far;
    logits: [V] fp32, the model's or the previous processor's (logprobs are taken before any).
    One instance serves one sequence (a grammar's matcher keeps its position); an exception from
    it stops the engine."""

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop it.

    Filters apply in the order of transformers' `generate`: repetition / presence / frequency
    penalties, then temperature, top-k, top-p, min-p. temperature 0 means greedy (argmax).
    """

    temperature: float = 1.0
    top_p: float = 1.0  # keep the smallest set of tokens whose probability sums to >= top_p
    top_k: int = -1  # keep the k most likely tokens; -1 or 0 = off
    min_p: float = 0.0  # drop tokens whose probability < min_p * max probability
    seed: int | None = None  # per-request generator: same seed -> same tokens in any batch
    repetition_penalty: float = 1.0  # HF: divide positive / multiply negative logits of seen tokens
    presence_penalty: float = 0.0  # OpenAI: subtract once for each token present in the output
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output
    stop: list[str] = field(default_factory=list)  # stop strings, checked after detokenising
    stop_token_ids: list[int] = field(default_factory=list)  # finish with "stop" on these ids
    max_tokens: int = 16  # finish with "length" after this many output tokens
    ignore_eos: bool = False  # keep going past the model's eos ids
    logprobs: int | None = None  # top logprobs returned with each token (StepDelta.logprobs); None: none
    logits_processors: list[LogitsProcessor] = field(default_factory=list)  # applied in order
    # token offsets in the prompt where chat messages end (the server's chat rendering sets them):
    # hybrid models checkpoint their linear-attention state there for the prefix cache
    message_ends: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logits_processors = list(self.logits_processors)
        self.message_ends = list(self.message_ends)
        self._check_floats()
        self._check_ints()
        self._check_lists()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def _check_floats(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not is_number or not math.isfinite(value):
                raise InvalidParameterError(name, f"{name} must be a finite number, got {value!r}")
        _require(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _require(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _require(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(-2 <= value <= 2, name, value, "in [-2, 2]")

    def _check_ints(self) -> None:
        for name in ("top_k", "max_tokens"):
            _require_int(getattr(self, name), name)
        _require(self.top_k in (-1, 0) or self.top_k >= 1, "top_k", self.top_k, "-1, 0 (off) or >= 1")
        _require(self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
        if self.seed is not None:
            _require_int(self.seed, "seed")
            _require(_SEED_MIN <= self.seed <= _SEED_MAX, "seed", self.seed, "a 64-bit integer")
        if self.logprobs is not None:
            _require_int(self.logprobs, "logprobs")
            _require(self.logprobs >= 0, "logprobs", self.logprobs, ">= 0 or None")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParameterError("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    def _check_lists(self) -> None:
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParameterError("stop", f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidParameterError("stop_token_ids", f"stop_token_ids must hold token ids >= 0, got {t!r}")
        for t in self.message_ends:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidParameterError("message_ends", f"message_ends must hold token offsets >= 0, got {t!r}")
        for proc in self.logits_processors:
            if not callable(proc):
                raise InvalidParameterError("logits_processors", f"logits_processors must hold callables, got {proc!r}")


def _require(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise InvalidParameterError(name, f"{name} must be {expected}, got {value!r}")


def _require_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(name, f"{name} must be an int, got {value!r}")
