"""Structured output through llguidance: JSON schemas become token masks applied to the logits.

Each constrained request carries its own `GrammarMatcher` among its SamplingParams' logits
processors. Each time the request samples, the engine (its thread) calls it: the matcher takes the
tokens sampled since the last call, fills the allowed-token bitmask and every other token's logit
becomes -inf. Once the grammar is complete only EOS is allowed, so the request stops.

JSON is generated compact (no free whitespace): a model cannot pad it with blanks forever.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from ferryman.server.errors import APIError

_JSON_OPTIONS = {"whitespace_flexible": False}
_NEG_INF = float("-inf")
_CHECKED_CACHE = 1024  # schemas whose structural check is remembered
log = logging.getLogger("ferryman.server")


class GrammarMatcher:
    """One request's position in its grammar, and its logits processor (a `LogitsProcessor`).

    Invariant: it never raises into the engine. When the matcher rejects a token or fails (a
    lexer or parser limit, an internal error), `error` says why, it is logged, and from then on
    only EOS is allowed, so the request ends at once; the API answers it with an error."""

    def __init__(self, matcher: Any, param: str, eos_token_ids: list[int] | None) -> None:
        self._m = matcher
        self._consumed = 0  # output tokens fed to the matcher so far
        self.param = param
        self.eos_token_ids = eos_token_ids or []
        self.error: str | None = None

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] -> [V] with the tokens the grammar does not allow next at -inf."""
        if self.error is None:
            try:
                self._consume(output_token_ids)
                if self.error is None:
                    return self._masked(logits)
            except Exception as e:  # noqa: BLE001 - an exception here would stop the engine
                self._fail(f"{type(e).__name__}: {e}")
        return self._eos_only(logits)

    def _consume(self, output_token_ids: list[int]) -> None:
        for t in output_token_ids[self._consumed:]:
            if not self._m.is_stopped() and not self._m.consume_token(t):
                self._fail(self._m.get_error() or f"token {t} was rejected")
                return
        self._consumed = len(output_token_ids)
        if self._m.is_error():
            self._fail(self._m.get_error())

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        bitmask = torch.zeros((1, (logits.shape[0] + 31) // 32), dtype=torch.int32)  # [1, W], V <= 32 W
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())
        if self._m.is_error():
            self._fail(self._m.get_error())
            return self._eos_only(logits)
        return apply_bitmask(logits.unsqueeze(0), bitmask)[0]

    def _fail(self, reason: str) -> None:
        self.error = (reason or "unknown error").strip().splitlines()[0]
        log.warning("structured output (%s) failed while generating: %s; the request ends with an error",
                    self.param, self.error)

    def _eos_only(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] -> [V], every token but EOS at -inf (unchanged without EOS ids)."""
        if not self.eos_token_ids:
            return logits
        out = torch.full_like(logits, _NEG_INF)
        ids = torch.tensor(self.eos_token_ids, device=logits.device)
        return out.index_copy(0, ids, logits.index_select(0, ids))


class CompiledGrammar:
    """A JSON schema compiled once per request; each choice samples through a copy of it."""

    def __init__(self, matcher: Any, param: str, eos_token_ids: list[int] | None) -> None:
        self._m, self.param, self.eos_token_ids = matcher, param, eos_token_ids

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._m.deep_copy(), self.param, self.eos_token_ids)


class GrammarCompiler:
    """Builds matchers for one tokenizer (the llguidance tokenizer is built once, lazily)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int] | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._ll_tokenizer: Any = None
        self._checked: dict[str, str] = {}  # schema JSON -> "" (valid) or why not; agents resend their tools

    def _llt(self, param: str) -> Any:
        if self._ll_tokenizer is None:
            if self.tokenizer is None:
                raise APIError(400, "structured output needs a model with a tokenizer", param)
            import llguidance.hf  # present: _grammar() checked

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._ll_tokenizer

    def check_schema(self, schema: Any, param: str) -> None:
        """A 400 naming `param` unless `schema` is a JSON schema: a structural check (no tokenizer,
        cached by the schema's text) of a schema shown to the model only. What llguidance does not
        implement (`propertyNames`, ECMA-only regex syntax) is no error here: the schema is valid."""
        if not isinstance(schema, dict):
            raise APIError(400, f"{param} must be a JSON object (a JSON schema)", param)
        key = json.dumps(schema)
        why = self._checked.get(key)
        if why is None:
            import llguidance as llg

            grammar = _grammar(_without_patterns(schema, param), param, lenient=True)
            is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, None)
            why = "; ".join(m.strip().splitlines()[0] for m in messages if m.strip()) if is_error else ""
            if len(self._checked) >= _CHECKED_CACHE:
                self._checked.clear()
            self._checked[key] = why
        if why:
            raise APIError(400, f"{param} is not a usable JSON schema: {why}", param)

    def compile(self, schema: Any, param: str, lenient: bool = False) -> CompiledGrammar:
        """The grammar of `schema` for this tokenizer, or a 400 naming `param`. lenient: keywords
        llguidance does not implement are ignored (a forced tool call: its runtime checks the
        arguments) instead of refused (response_format: the output must match the schema)."""
        import llguidance as llg

        grammar = _grammar(schema, param, lenient)
        tok = self._llt(param)
        err = llg.LLMatcher.validate_grammar(grammar, tok)
        if err and not err.startswith("WARNING"):
            raise APIError(400, f"{param} cannot be compiled to a grammar: {err.strip().splitlines()[0]}", param)
        m = llg.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise APIError(400, f"{param} cannot be compiled to a grammar: {m.get_error().strip().splitlines()[0]}",
                           param)
        return CompiledGrammar(m, param, self.eos_token_ids)

    def json_schema(self, schema: Any, param: str) -> GrammarMatcher:
        """One matcher of `schema` (compiles it; a request with n choices uses `compile` once)."""
        return self.compile(schema, param).matcher()


def _grammar(schema: Any, param: str, lenient: bool = False) -> str:
    """A JSON schema -> llguidance's grammar text, or a 400 naming `param`."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON object (a JSON schema)", param)
    try:
        import llguidance as llg
    except ImportError:
        raise APIError(400, "structured output needs the llguidance package: pip install llguidance",
                       param) from None
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides={**_JSON_OPTIONS,
                                                                                     "lenient": lenient})
    except (ValueError, TypeError) as e:
        raise APIError(400, f"{param} is not a usable JSON schema: {e}", param) from None


def _without_patterns(schema: dict[str, Any], param: str) -> dict[str, Any]:
    """`schema` without its regexes: JSON Schema's are ECMA-262, llguidance's engine lacks some
    of it (lookarounds, backreferences), and a schema only shown to the model needs none."""
    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items()
                    if not (k == "pattern" and isinstance(v, str)) and k != "patternProperties"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    try:
        return strip(schema)
    except RecursionError:
        raise APIError(400, f"{param} is nested too deeply", param) from None


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
