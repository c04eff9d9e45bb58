"""Reasoning and tool-call parsers: model output -> (reasoning, content, tool calls), incrementally.

A parser is fed each step's new token ids and text and returns what became certain; text that
could still be the start of a tag is held back until the next feed (or `finish`).

Qwen3 family (and Hermes-style templates): `<think>...</think>` holds the reasoning (a prompt that
ends with `<think>` means the output starts inside it), `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` one tool call each. gpt-oss (harmony) lives in `harmony.py`.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from ferryman.engine.detokenizer import partial_suffix_len

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (a call whose arguments are not one is not complete)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    @property
    def complete(self) -> bool:
        """The arguments are a whole JSON object (a call cut by max_tokens is not)."""
        return json_object(self.arguments) is not None

    def arguments_dict(self) -> dict[str, Any]:
        return json_object(self.arguments) or {}


def json_object(text: str) -> dict[str, Any] | None:
    """`text` parsed, when it is a JSON object; else None."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None
    return value if isinstance(value, dict) else None


@dataclass
class Parsed:
    """What a feed made certain, or (extended feed after feed) the whole output."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    cut_call: bool = False  # the output ended inside a tool call (not returned as one)

    def extend(self, other: Parsed) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        self.cut_call = self.cut_call or other.cut_call


class OutputParser(ABC):
    @abstractmethod
    def feed(self, token_ids: list[int], text: str) -> Parsed: ...

    @abstractmethod
    def finish(self) -> Parsed:
        """End of output: flush what was held back."""


class PlainParser(OutputParser):
    """No reasoning, no tools: every character is content."""

    def feed(self, token_ids: list[int], text: str) -> Parsed:
        return Parsed(content=text)

    def finish(self) -> Parsed:
        return Parsed()


def parse_tool_json(body: str) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` (Hermes / Qwen3) -> ToolCall; None if it is not one
    (arguments that are not a JSON object, or JSON text of one, make it not one)."""
    obj = json_object(body)
    if obj is None or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json_object(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class Qwen3Parser(OutputParser):
    """State machine over text: content <-> reasoning (`<think>`) and content <-> tool call."""

    def __init__(self, tools: bool = True, starts_in_reasoning: bool = False) -> None:
        self.tools_enabled = tools
        self.mode = "reasoning" if starts_in_reasoning else "content"
        self.buf = ""
        self.seen_output = False  # any content emitted: a later <think> is plain text
        self.strip_newlines = False  # drop the blank lines that follow </think>

    def feed(self, token_ids: list[int], text: str) -> Parsed:
        self.buf += text
        out = Parsed()
        while self._advance(out):
            pass
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        rest, self.buf = self.buf, ""
        if self.mode == "tool":
            call = parse_tool_json(rest.strip())
            if call is not None:
                out.tool_calls.append(call)
            else:  # cut before </tool_call>: the model's text, flagged so no finish says the call ended
                out.content += TOOL_OPEN + rest
                out.cut_call = True
        elif self.mode == "reasoning":
            out.reasoning += rest
        else:
            out.content += self._content(rest)
        return out

    def _content(self, text: str) -> str:
        if self.strip_newlines:
            text = text.lstrip("\n")
            self.strip_newlines = not text
        if text.strip():
            self.seen_output = True
        return text

    def _open_tags(self) -> tuple[str, ...]:
        tags = (TOOL_OPEN,) if self.tools_enabled else ()
        if not self.seen_output:
            tags += (THINK_OPEN,)
        return tags

    def _take(self, tags: tuple[str, ...]) -> str:
        """The buffer but a tail that could still start one of `tags` (held back)."""
        cut = len(self.buf) - partial_suffix_len(self.buf, tags)
        emit, self.buf = self.buf[:cut], self.buf[cut:]
        return emit

    def _advance(self, out: Parsed) -> bool:
        """Consume the buffer up to the next tag; True when a tag was found (call again)."""
        if self.mode == "reasoning":
            return self._reasoning(out)
        if self.mode == "tool":
            return self._tool_body(out)
        tags = self._open_tags()
        hits = [(self.buf.find(t), t) for t in tags if t in self.buf]
        if not hits:
            out.content += self._content(self._take(tags))
            return False
        idx, tag = min(hits)
        before = self.buf[:idx]
        if tag == THINK_OPEN and before.strip():
            out.content += self._content(before + tag)  # <think> after real content: plain text
        else:
            out.content += self._content(before) if tag == TOOL_OPEN else ""
            self.mode = "tool" if tag == TOOL_OPEN else "reasoning"
        self.buf = self.buf[idx + len(tag):]
        return True

    def _reasoning(self, out: Parsed) -> bool:
        idx = self.buf.find(THINK_CLOSE)
        if idx == -1:
            out.reasoning += self._take((THINK_CLOSE,))
            return False
        out.reasoning += self.buf[:idx]
        return self._close(idx + len(THINK_CLOSE))

    def _tool_body(self, out: Parsed) -> bool:
        idx = self.buf.find(TOOL_CLOSE)
        if idx == -1:
            return False  # a tool call is emitted whole, once closed
        body = self.buf[:idx]
        call = parse_tool_json(body.strip())
        if call is not None:
            out.tool_calls.append(call)
        else:
            out.content += self._content(TOOL_OPEN + body + TOOL_CLOSE)
        return self._close(idx + len(TOOL_CLOSE))

    def _close(self, end: int) -> bool:
        """A block closed at buf[:end]: back to content, without the blank lines that follow."""
        self.buf = self.buf[end:]
        self.mode = "content"
        self.strip_newlines = True
        return True


class ForcedToolParser(OutputParser):
    """A grammar-forced tool call, whole output: the arguments of the function `name` (tool_choice
    naming it) or, without a name (tool_choice "required"), `{"name": ..., "arguments": {...}}`.
    The wrapper is ours, never content: an output that is not a whole call (cut by max_tokens)
    returns nothing but the `cut_call` flag."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self.text = ""

    def feed(self, token_ids: list[int], text: str) -> Parsed:
        self.text += text
        return Parsed()

    def finish(self) -> Parsed:
        text = self.text.strip()
        if self.name is None:
            call = parse_tool_json(text)
        else:
            call = ToolCall(self.name, text) if json_object(text) is not None else None
        return Parsed(tool_calls=[call]) if call is not None else Parsed(cut_call=True)
