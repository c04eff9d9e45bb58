"""Chat messages -> prompt token ids through the model's chat template.

Messages use the OpenAI shape (the Anthropic API converts to it): role, content (text), and for
assistants `tool_calls` (arguments as JSON text or an object), for tool results `tool_call_id`.
A template that knows tools (Qwen3, gpt-oss) gets them natively; one that does not (the demo
model's plain ChatML) gets them in the Hermes / Qwen3 text convention: a `# Tools` system block,
`<tool_call>` in assistant turns and `<tool_response>` user turns, which is also what the Qwen3
parser reads back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ferryman.server.errors import APIError
from ferryman.server.parsers import THINK_OPEN, TOOL_CLOSE, TOOL_OPEN

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass
class ChatPrompt:
    token_ids: list[int]
    text: str

    @property
    def ends_in_reasoning(self) -> bool:
        """The template opened a `<think>` block the model is to continue."""
        return self.text.rstrip().endswith(THINK_OPEN)


def _arguments_obj(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


class ChatRenderer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default") or next(iter(template.values()), None)
        self.template: str | None = template
        self.native_tools = bool(template) and "tools" in template

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
        """The prompt of a conversation; a 400 on `messages` when the template rejects it."""
        if self.tokenizer is None:
            raise APIError(400, "this model ships no tokenizer, so it cannot take chat messages", "messages")
        if not self.template:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
        msgs = [_native_message(m) for m in messages] if self.native_tools else _hermes_messages(messages, tools)
        kwargs = dict(template_kwargs or {})
        if tools and self.native_tools:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as e:  # jinja raises anything: undefined names, raise_exception(...)
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ChatPrompt(list(ids), text)


def _native_message(m: dict[str, Any]) -> dict[str, Any]:
    """Template conventions: content a string, tool-call arguments a mapping."""
    out = dict(m)
    out["content"] = m.get("content") or ""
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _arguments_obj(c["function"].get("arguments"))}}
            for c in m["tool_calls"]
        ]
    return out


def _hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [_hermes_call(c) for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        block = _TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _hermes_call(call: dict[str, Any]) -> str:
    fn = call["function"]
    body = {"name": fn["name"], "arguments": _arguments_obj(fn.get("arguments") or {})}
    return f"{TOOL_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{TOOL_CLOSE}"
