"""Structured output through llguidance: JSON schemas become token masks applied to the logits.

Each constrained request carries its own `GrammarMatcher` among its SamplingParams' logits
processors. Each time the request samples, the engine (its thread) calls it: the matcher takes the
tokens sampled since the last call, fills the allowed-token bitmask and every other token's logit
becomes -inf. Once the grammar is complete only EOS is allowed, so the request stops.

JSON is generated compact (no free whitespace): a model cannot pad it with blanks forever.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ferryman.server.errors import APIError

_JSON_OPTIONS = {"whitespace_flexible": False}
_NEG_INF = float("-inf")


class GrammarMatcher:
    """One request's position in its grammar, and its logits processor (a `LogitsProcessor`)."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher
        self._consumed = 0  # output tokens fed to the matcher so far

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] -> [V] with the tokens the grammar does not allow next at -inf."""
        for t in output_token_ids[self._consumed:]:
            if not self._m.is_stopped():
                self._m.consume_token(t)
        self._consumed = len(output_token_ids)
        bitmask = torch.zeros((1, (logits.shape[0] + 31) // 32), dtype=torch.int32)  # [1, W], V <= 32 W
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())
        return apply_bitmask(logits.unsqueeze(0), bitmask)[0]


class GrammarCompiler:
    """Builds matchers for one tokenizer (the llguidance tokenizer is built once, lazily)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int] | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._ll_tokenizer: Any = None

    def _llt(self) -> Any:
        if self._ll_tokenizer is None:
            if self.tokenizer is None:
                raise APIError(400, "structured output needs a model with a tokenizer", "response_format")
            import llguidance.hf  # present: json_schema() checked

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._ll_tokenizer

    def json_schema(self, schema: dict[str, Any], param: str) -> GrammarMatcher:
        if not isinstance(schema, dict):
            raise APIError(400, f"{param} must be a JSON object (a JSON schema)", param)
        try:
            import llguidance as llg
        except ImportError:
            raise APIError(400, "structured output needs the llguidance package: pip install llguidance",
                           "response_format") from None
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_JSON_OPTIONS)
        except ValueError as e:
            raise APIError(400, f"{param} is not a usable JSON schema: {e}", param) from None
        tok = self._llt()
        err = llg.LLMatcher.validate_grammar(grammar, tok)
        if err and not err.startswith("WARNING"):
            raise APIError(400, f"{param} cannot be compiled to a grammar: {err}", param)
        m = llg.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise APIError(400, f"{param} cannot be compiled to a grammar: {m.get_error()}", param)
        return GrammarMatcher(m)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits: [R, V], bitmask: [R, W] int32 (bit j of word w allows token 32 w + j) -> [R, V]
    with disallowed tokens at -inf; tokens past 32 W are disallowed. The words (V / 8 bytes) go to
    the logits' device and are expanded there, not the V-sized mask on the host."""
    R, V = logits.shape
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.view(R, -1).bool()  # [R, 32 W]
    if allowed.shape[1] < V:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    return logits.masked_fill(~allowed[:, :V], _NEG_INF)
