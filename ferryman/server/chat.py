"""Chat messages -> prompt token ids through the model's chat template.

Messages use the OpenAI shape (the Anthropic API converts to it): role, content (text), and for
assistants `tool_calls` (arguments as JSON text or an object), for tool results `tool_call_id`.
A template that knows tools (Qwen3, gpt-oss) gets them natively; one that does not (the demo
model's plain ChatML) gets them in the Hermes / Qwen3 text convention: a `# Tools` system block,
`<tool_call>` in assistant turns and `<tool_response>` user turns, which is also what the Qwen3
parser reads back.

No client code runs unless the server trusts it: a template sent with the request (the
`chat_template` field, or `chat_template_kwargs.chat_template`) is a 400 naming the field, unless
`--trust-request-chat-template`; then it renders in `template.BoundedSandbox`. Every render runs
under a deadline (`template.deadline`), and its text is at most `max_chars` characters, checked
on the messages before rendering and on the text before tokenising.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ferryman.server.errors import APIError
from ferryman.server.parsers import THINK_OPEN, TOOL_CLOSE, TOOL_OPEN
from ferryman.server.template import BoundedSandbox, TemplateLimitError, deadline, weight

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


# apply_chat_template's own arguments: a template variable of these names would change what it
# returns or reads, so chat_template_kwargs may not set them
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})


ENDS_KEPT = 2  # message ends passed to the engine (kvcache/state_checkpoints.py checkpoints as many)


@dataclass(frozen=True)
class RenderLimits:
    max_chars: int = 1 << 20  # messages before rendering, the rendered text before tokenising
    timeout_s: float = 2.0  # one template render
    trust_client_template: bool = False  # render templates sent with requests (sandboxed)


@dataclass
class ChatPrompt:
    token_ids: list[int]
    text: str
    message_ends: list[int] = field(default_factory=list)  # token offsets where earlier messages end

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


def bad_text_field(value: Any, path: str) -> str | None:
    """The path of the first string under `value` that is not valid Unicode (a lone surrogate such
    as JSON's "\\ud800", which no tokenizer can encode); None when all are valid."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items: Any = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((bad for p, v in items if (bad := bad_text_field(v, p)) is not None), None)


def check_text(value: Any, path: str) -> None:
    """A 400 naming the field that holds a lone surrogate."""
    bad = bad_text_field(value, path)
    if bad is not None:
        raise APIError(400, f"invalid field '{bad}': the text holds a lone surrogate (not valid Unicode); "
                            "send UTF-8 text", bad)


def check_size(chars: int, limit: int, what: str, param: str) -> None:
    if chars > limit:
        raise APIError(400, f"{what} is {chars} characters or more; the limit is {limit} characters "
                            "(max_prompt_chars)", param)


class ChatRenderer:
    def __init__(self, tokenizer: Any, limits: RenderLimits | None = None, message_ends: bool = False) -> None:
        """message_ends: find where the last messages end (ChatPrompt.message_ends) for the engine."""
        self.tokenizer = tokenizer
        self.message_ends = message_ends
        self.limits = limits or RenderLimits()
        template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default") or next(iter(template.values()), None)
        self.template: str | None = template
        self.native_tools = bool(template) and "tools" in template

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None, client_template: str | None = None,
               tokenizer: Any = None) -> ChatPrompt:
        """The prompt of a conversation; a 400 naming the field when the messages, the template
        kwargs or a client template are refused or the template rejects them. `tokenizer`: the
        calling thread's copy (default: the renderer's)."""
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        if tokenizer is None:
            raise APIError(400, "this model ships no tokenizer, so it cannot take chat messages", "messages")
        kwargs = dict(template_kwargs or {})
        source, param = self._source(kwargs.pop("chat_template", None), client_template)
        bad = sorted(_RESERVED_KWARGS & kwargs.keys())
        if bad:
            raise APIError(400, f"chat_template_kwargs may not set '{bad[0]}'", f"chat_template_kwargs.{bad[0]}")
        check_text(messages, "messages")
        check_text(tools, "tools")
        check_text(kwargs, "chat_template_kwargs")
        limit = self.limits.max_chars
        check_size(weight(messages, limit) + weight(tools, limit), limit, "the conversation", "messages")
        native = self.native_tools if source is None else "tools" in source
        msgs = [_native_message(m) for m in messages] if native else _hermes_messages(messages, tools)
        if tools and native:
            kwargs["tools"] = tools
        text = self._render(tokenizer, source, msgs, kwargs, param)
        check_size(len(text), limit, "the rendered prompt", "messages")
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        ends = message_ends(tokenizer, msgs, kwargs, text, ids) if self.message_ends and source is None else []
        return ChatPrompt(ids, text, ends)

    def _source(self, in_kwargs: Any, in_body: str | None) -> tuple[str | None, str]:
        """The client's template (None: the model's) and the field it came in."""
        given = [(v, p) for v, p in ((in_kwargs, "chat_template_kwargs.chat_template"), (in_body, "chat_template"))
                 if v is not None]
        if not given:
            if not self.template:
                raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
            return None, "messages"
        source, param = given[0]
        if not self.limits.trust_client_template:
            raise APIError(400, f"'{param}' is refused: this server renders only the model's own chat template "
                                "(start it with --trust-request-chat-template to accept templates from requests)",
                           param)
        if not isinstance(source, str) or not source:
            raise APIError(400, f"invalid field '{param}': a chat template is a non-empty string", param)
        check_text(source, param)
        check_size(len(source), self.limits.max_chars, "the chat template", param)
        return source, param

    def _render(self, tokenizer: Any, source: str | None, msgs: list[dict[str, Any]], kwargs: dict[str, Any],
                param: str) -> str:
        what = "the model's chat template" if source is None else f"the chat template in '{param}'"
        try:
            with deadline(self.limits.timeout_s, what):
                if source is None:
                    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kwargs)
                variables = {**tokenizer.special_tokens_map, **kwargs, "messages": msgs,
                             "add_generation_prompt": True}
                variables.setdefault("tools", None)
                return BoundedSandbox(self.limits.max_chars).render(source, variables)
        except TemplateLimitError as e:
            raise APIError(400, str(e), param) from None
        except Exception as e:  # jinja raises anything: undefined names, raise_exception(...), SecurityError
            raise APIError(400, f"{what} rejected the messages: {type(e).__name__}: {e}", param) from None


def message_ends(tokenizer: Any, msgs: list[dict[str, Any]], kwargs: dict[str, Any], text: str,
                 ids: list[int]) -> list[int]:
    """Token offsets in `ids` where the messages before the last one end (the last
    ENDS_KEPT of them), for the engine's prefix cache (SamplingParams.message_ends). An end counts only
    where the conversation up to it renders to a prefix of `text` that tokenises to a prefix of `ids`;
    a template that renders prefixes differently, or refuses them, gives fewer ends (never an error)."""
    ends = []
    for k in range(max(1, len(msgs) - ENDS_KEPT), len(msgs)):
        try:
            head = tokenizer.apply_chat_template(msgs[:k], add_generation_prompt=False, tokenize=False, **kwargs)
        except Exception:  # a template may refuse a conversation that ends with an assistant message
            continue
        if not isinstance(head, str) or not text.startswith(head):
            continue
        head_ids = tokenizer.encode(head, add_special_tokens=False)
        if 0 < len(head_ids) < len(ids) and ids[:len(head_ids)] == list(head_ids):
            ends.append(len(head_ids))
    return ends


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
