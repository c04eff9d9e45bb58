"""Output parsers (Qwen3 tags, gpt-oss harmony), grammar masks and chat rendering, without a server."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")

from ferryman.llm import DEMO_MODEL  # noqa: E402
from ferryman.server.chat import ChatRenderer  # noqa: E402
from ferryman.server.grammar import apply_bitmask  # noqa: E402
from ferryman.server.harmony import MARKERS, HarmonyParser, harmony_marker_ids  # noqa: E402
from ferryman.server.parsers import OutputParser, Parsed, Qwen3Parser  # noqa: E402

QWEN_OUT = ('<think>\nThe user asks for weather.\n</think>\n\nChecking now.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_MODEL))


def _parse_all(parser: OutputParser, token_ids: list[int], text: str) -> Parsed:
    """The whole output in one feed."""
    out = parser.feed(token_ids, text)
    out.extend(parser.finish())
    return out


def _feed_in_pieces(parser, text: str, size: int) -> Parsed:
    out = Parsed()
    for i in range(0, len(text), size):
        out.extend(parser.feed([], text[i:i + size]))
    out.extend(parser.finish())
    return out


def test_qwen3_whole_output() -> None:
    p = _parse_all(Qwen3Parser(), [], QWEN_OUT)
    assert p.reasoning == "\nThe user asks for weather.\n"
    assert p.content == "Checking now.\n"
    assert [(c.name, json.loads(c.arguments)) for c in p.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {})]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 16])
def test_qwen3_streaming_equals_whole(size: int) -> None:
    whole = _parse_all(Qwen3Parser(), [], QWEN_OUT)
    pieces = _feed_in_pieces(Qwen3Parser(), QWEN_OUT, size)
    assert (pieces.reasoning, pieces.content) == (whole.reasoning, whole.content)
    assert [(c.name, c.arguments) for c in pieces.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_qwen3_edge_cases() -> None:
    # prompt ended inside <think>: the output starts with reasoning
    p = _parse_all(Qwen3Parser(starts_in_reasoning=True), [], "plan it</think>\n\nDone.")
    assert (p.reasoning, p.content) == ("plan it", "Done.")
    # a <think> after real content is text; a broken tool call stays content; '<' alone is not held forever
    p = _parse_all(Qwen3Parser(), [], "a <think> b <tool_call>{oops}</tool_call> c <")
    assert p.content == "a <think> b <tool_call>{oops}</tool_call> c <" and not p.tool_calls
    # tools off: <tool_call> is plain content
    p = _parse_all(Qwen3Parser(tools=False), [], '<tool_call>{"name": "x", "arguments": {}}</tool_call>')
    assert p.tool_calls == [] and p.content.startswith("<tool_call>")
    # unterminated reasoning at the end
    assert _parse_all(Qwen3Parser(), [], "<think>still thinking").reasoning == "still thinking"


def _harmony_tokenizer(tokenizer):
    tok = tokenizer.__class__.from_pretrained(str(DEMO_MODEL))
    tok.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    return tok


def test_harmony_parser(tokenizer) -> None:
    tok = _harmony_tokenizer(tokenizer)
    markers = harmony_marker_ids(tok)
    assert markers is not None and harmony_marker_ids(tokenizer) is None
    # the output after a prompt ending in <|start|>assistant (example from the harmony format guide)
    out = ("<|channel|>analysis<|message|>User asks weather in Tokyo. Use the tool.<|end|>"
           "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
           '{"location":"Tokyo"}<|call|>')
    ids = tok.encode(out, add_special_tokens=False)
    whole = _parse_all(HarmonyParser(tok, markers), ids, "")
    assert whole.reasoning == "User asks weather in Tokyo. Use the tool." and whole.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("get_weather", {"location": "Tokyo"})]
    streamed, p = Parsed(), HarmonyParser(tok, markers)
    for t in ids:
        streamed.extend(p.feed([t], ""))
    streamed.extend(p.finish())
    assert streamed.reasoning == whole.reasoning and streamed.tool_calls[0].arguments == whole.tool_calls[0].arguments
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4<|return|>"
    p2 = _parse_all(HarmonyParser(tok, markers), tok.encode(final, add_special_tokens=False), "")
    assert (p2.reasoning, p2.content, p2.tool_calls) == ("Easy.", "2 + 2 = 4", [])
    # recipient before the channel (also allowed by the format)
    alt = '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": 1}<|call|>'
    p3 = _parse_all(HarmonyParser(tok, markers), tok.encode(alt, add_special_tokens=False), "")
    assert p3.tool_calls[0].name == "lookup"


def test_bitmask_matches_llguidance_reference() -> None:
    llg_np = pytest.importorskip("llguidance.numpy")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 100, generator=gen)
    mask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    ours = apply_bitmask(logits, mask)
    ref = logits.numpy().copy()
    llg_np.apply_token_bitmask_inplace(ref, mask.numpy())
    np.testing.assert_array_equal(ours.numpy(), ref)
    wide = torch.randn(3, 140, generator=gen)  # vocab past the mask words: disallowed
    assert torch.isinf(apply_bitmask(wide, mask)[:, 128:]).all()


def test_hermes_tool_rendering_round_trips(tokenizer) -> None:
    """The demo's plain ChatML template gets tools in the Qwen3 text convention, which the parser reads back."""
    r = ChatRenderer(tokenizer)
    assert not r.native_tools
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "files?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.py"}]
    prompt = r.render(msgs, tools)
    assert prompt.text.startswith("<|im_start|>system\nBe terse.\n\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "ls"' in prompt.text
    assert "<|im_start|>user\n<tool_response>\na.py\n</tool_response><|im_end|>" in prompt.text
    assert prompt.text.endswith("<|im_start|>assistant\n")
    assert prompt.token_ids == tokenizer.encode(prompt.text, add_special_tokens=False)
    turn = prompt.text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = _parse_all(Qwen3Parser(), [], turn)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("ls", {"path": "."})]


def test_native_tool_template(tokenizer) -> None:
    """A template that renders tools itself gets them (and arguments as a mapping)."""
    tok = tokenizer.__class__.from_pretrained(str(DEMO_MODEL))
    tok.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                         "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                         "{{ c.function.arguments.path }}{% endfor %};{% endfor %}")
    r = ChatRenderer(tok)
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "ls", "arguments": '{"path": "/tmp"}'}}]}]
    text = r.render(msgs, [{"type": "function", "function": {"name": "ls"}}]).text
    assert r.native_tools and text == "[ls]assistant:/tmp;"
