"""Grammar matchers without a server: one compile per schema, a rejected token or a failing
matcher ends the request through EOS (never an exception into the engine), and tool-call parsing
returns only whole calls."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llguidance")

from transformers import AutoTokenizer  # noqa: E402

from ferryman.llm import DEMO_MODEL  # noqa: E402
from ferryman.server.errors import APIError  # noqa: E402
from ferryman.server.grammar import GrammarCompiler, GrammarMatcher  # noqa: E402
from ferryman.server.parsers import ForcedToolParser, Qwen3Parser, parse_tool_json  # noqa: E402

EOS = 0
SCHEMA = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    return GrammarCompiler(tok, len(tok), [EOS])


def _logits(compiler: GrammarCompiler) -> torch.Tensor:
    return torch.zeros(compiler.vocab_size)  # [V]


def test_rejected_token_ends_with_eos(compiler: GrammarCompiler, caplog: pytest.LogCaptureFixture) -> None:
    m = compiler.compile(SCHEMA, "response_format").matcher()
    first = m([], _logits(compiler))
    assert torch.isfinite(first).sum() < compiler.vocab_size and m.error is None
    bad = compiler.tokenizer.encode("hello", add_special_tokens=False)[0]
    assert first[bad] == float("-inf")
    out = m([bad], _logits(compiler))  # a token the grammar forbids got through
    assert m.error is not None and "response_format" in caplog.text
    assert torch.isfinite(out).nonzero().flatten().tolist() == [EOS]


def test_matcher_exception_never_reaches_the_engine(compiler: GrammarCompiler) -> None:
    class Broken:  # an llguidance matcher whose every call fails
        def __getattr__(self, name: str):
            raise RuntimeError("lexer exploded")

    m = GrammarMatcher(Broken(), "tools[0].function.parameters", [EOS])
    out = m([5], _logits(compiler))
    assert m.error == "RuntimeError: lexer exploded"
    assert torch.isfinite(out).nonzero().flatten().tolist() == [EOS]


def test_copies_are_independent(compiler: GrammarCompiler) -> None:
    compiled = compiler.compile(SCHEMA, "response_format")
    a, b = compiled.matcher(), compiled.matcher()
    brace = compiler.tokenizer.encode("{", add_special_tokens=False)[0]
    a([], _logits(compiler))
    a([brace], _logits(compiler))
    b_first = b([], _logits(compiler))
    assert b_first[brace] == 0.0 and a.error is None and b.error is None


@pytest.mark.parametrize("schema, why", [({"type": "strin"}, "Invalid type"), ({"required": "a"}, "required"),
                                         ([1], "JSON object"), ({"properties": 5}, "properties"),
                                         ({"$ref": "#/$defs/nope"}, "nope")])
def test_bad_schemas_name_the_field(compiler: GrammarCompiler, schema, why: str) -> None:
    with pytest.raises(APIError) as e:
        compiler.check_schema(schema, "tools[2].function.parameters")
    assert e.value.param == "tools[2].function.parameters" and why in e.value.message
    assert "\n" not in e.value.message


def test_valid_schemas_llguidance_cannot_enforce_pass(compiler: GrammarCompiler) -> None:
    """Claude Code's tools use `propertyNames`; MCP servers send ECMA regexes (lookaheads)."""
    compiler.check_schema({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, "tools[0].input_schema")
    compiler.check_schema({"type": "string", "pattern": "^(?!-)[a-z-]+$"}, "tools[1].input_schema")
    compiler.compile({"type": "object", "propertyNames": {"maxLength": 3}}, "tools[0].input_schema", lenient=True)
    with pytest.raises(APIError, match="propertyNames"):  # response_format: refused, not approximated
        compiler.compile({"type": "object", "propertyNames": {"maxLength": 3}}, "response_format")


def test_only_whole_calls_are_calls() -> None:
    assert parse_tool_json('{"name": "f", "arguments": "{\\"x\\": 1}"}').arguments == '{"x": 1}'
    assert parse_tool_json('{"name": "f", "arguments": "not json"}') is None
    assert parse_tool_json('{"name": "f", "arguments": [1]}') is None
    cut = ForcedToolParser("f")
    cut.feed([], '{"x": ')
    assert cut.finish().tool_calls == [] and ForcedToolParser("f").finish().cut_call
    wrapper = ForcedToolParser()
    wrapper.feed([], '{"name": "f", "argu')
    out = wrapper.finish()
    assert out.content == "" and out.tool_calls == [] and out.cut_call
    p = Qwen3Parser()
    out = p.feed([], 'ok <tool_call>\n{"name": "f", "argum')
    out.extend(p.finish())
    assert out.cut_call and not out.tool_calls
