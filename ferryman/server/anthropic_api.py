"""Anthropic API: /v1/messages (whole and streamed) and /v1/messages/count_tokens.

Messages are converted to the OpenAI shape and rendered by the same chat template; `tool_use`
blocks become assistant tool calls, `tool_result` blocks tool messages, a `system` message inside
`messages` (beta mid-conversation-system-2026-04-07) a system message at that point, reasoning
comes back as `thinking` blocks. Usage follows Anthropic: `input_tokens` excludes the prompt tokens
the prefix cache served (`cache_read_input_tokens`), the same in message_start and message_delta.
Streams follow Anthropic's event sequence: message_start, ping, per block content_block_start /
*_delta / content_block_stop, message_delta (stop_reason, usage), message_stop.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import APIRouter, Request

from ferryman.server.chat import ChatPrompt
from ferryman.server.errors import APIError
from ferryman.server.generation import Choice, GenSpec, generate, make_params, sse, stream
from ferryman.server.limits import check_stops, check_unicode
from ferryman.server.parsers import Parsed, ToolCall
from ferryman.server.protocol import ACountTokensRequest, AMessage, AMessagesRequest
from ferryman.server.state import ServerState
from ferryman.server.tooling import ToolSetup, tool_setup

router = APIRouter()
log = logging.getLogger("ferryman.server")


def _text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _system_text(i: int, m: AMessage) -> str:
    """A mid-conversation system message: its text (text blocks only)."""
    if isinstance(m.content, str):
        return m.content
    for j, b in enumerate(m.content):
        if b.type != "text":
            raise APIError(400, f"a system message holds text blocks only, got {b.type}",
                           f"messages[{i}].content[{j}].type",
                           anthropic_message=f"messages.{i}.content.{j}.type: a system message holds text blocks only")
    return _text(m.content)


def _message_dicts(i: int, m: AMessage) -> list[dict[str, Any]]:
    if m.role == "system":
        return [{"role": "system", "content": _system_text(i, m)}]
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    tool_results, texts, calls = [], [], []
    for j, b in enumerate(m.content):
        if b.type in ("image", "document"):
            raise APIError(400, f"{b.type} content is not supported by this server", f"messages[{i}].content[{j}]")
        if b.type == "text":
            texts.append(b.text)
        elif b.type == "tool_result":
            tool_results.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
        elif b.type == "tool_use":
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
    msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return tool_results + ([msg] if texts or calls or not tool_results else [])


def _as_reminders(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mid-conversation system messages as `<system-reminder>` text in the user turn they follow
    (or a user turn of their own), for chat templates that allow a system message first only."""
    out: list[dict[str, Any]] = []
    for k, m in enumerate(messages):
        if m["role"] != "system" or k == 0:
            out.append(m)
            continue
        reminder = f"<system-reminder>\n{m['content']}\n</system-reminder>"
        if out and out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{reminder}"}
        else:
            out.append({"role": "user", "content": reminder})
    return out


async def _render(st: ServerState, messages: list[dict[str, Any]], setup: ToolSetup,
            kwargs: dict[str, Any] | None) -> ChatPrompt:
    """The prompt, with system messages where they stand; a template that refuses a system
    message after the first gets them as reminders in the user turns instead."""
    try:
        return await st.chat_prompt(messages, setup.tools, kwargs)
    except APIError:
        if not any(m["role"] == "system" for m in messages[1:]):
            raise
    log.info("the chat template refused a system message mid-conversation: sent as a user-turn reminder")
    return await st.chat_prompt(_as_reminders(messages), setup.tools, kwargs)


async def _prompt(st: ServerState, body: ACountTokensRequest) -> tuple[ChatPrompt, ToolSetup]:
    st.check_model(body.model)
    check_unicode(body)
    messages = [{"role": "system", "content": _text(body.system)}] if body.system else []
    for i, m in enumerate(body.messages):
        messages.extend(_message_dicts(i, m))
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                "parameters": t.input_schema}} for t in body.tools or []]
    choice = None
    if body.tool_choice is not None:
        tc = body.tool_choice
        if tc.type == "tool" and not tc.name:
            raise APIError(400, "tool_choice.name is required when tool_choice.type is 'tool'", "tool_choice.name")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type, f"function:{tc.name}")
    fmt = body.output_config.format if body.output_config is not None else None
    setup = tool_setup(st, tools or None, choice, fmt.schema_ if fmt is not None else None,
                       format_param="output_config.format",
                       tool_params=[f"tools[{i}].input_schema" for i in range(len(tools))])
    kwargs = {"enable_thinking": body.thinking.type != "disabled"} if body.thinking else None
    return await _render(st, messages, setup, kwargs), setup


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: ACountTokensRequest, request: Request) -> dict[str, Any]:
    prompt, _ = await _prompt(request.app.state.ferryman, body)
    return {"input_tokens": len(prompt.token_ids)}


@router.post("/v1/messages")
async def messages(body: AMessagesRequest, request: Request) -> Any:
    st: ServerState = request.app.state.ferryman
    if "n" in body.model_fields_set:
        raise APIError(400, "n is not a field of the Messages API (one message per request)", "n",
                       anthropic_message="n: Extra inputs are not permitted")
    prompt, setup = await _prompt(st, body)
    st.check_prompt(prompt.token_ids, "messages")
    stops = check_stops(list(body.stop_sequences or []), st.cfg, "stop_sequences")
    params = make_params({"stop": "stop_sequences"}, temperature=body.temperature, top_p=body.top_p,
                         top_k=body.top_k, stop=stops,
                         max_tokens=st.max_tokens(body.max_tokens, len(prompt.token_ids)),
                         message_ends=prompt.message_ends)
    spec = GenSpec(prompt.token_ids, params, 1, setup.grammar, setup.parser_factory(prompt))
    message = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": body.model}
    if body.stream:
        return _stream(st, spec, message, body)
    choice = (await generate(st, [spec], request))[0]
    reason, seq = _stop_reason(st, choice, body)
    return {**message, "content": _blocks(choice.parsed), "stop_reason": reason, "stop_sequence": seq,
            "usage": _usage(len(prompt.token_ids), choice)}


def _stream(st: ServerState, spec: GenSpec, message: dict[str, Any], body: AMessagesRequest) -> Any:
    """message_start waits for the first delta: by then the prefix cache has been looked up, so
    its usage (cache reads apart) is the one message_delta repeats at the end."""
    writer = _BlockWriter()
    started = False

    def start(c: Choice) -> list[str]:
        nonlocal started
        if started:
            return []
        started = True
        head = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {**_usage(len(spec.prompt_ids), c), "output_tokens": 0}}
        return [sse({"type": "message_start", "message": head}, "message_start"), sse({"type": "ping"}, "ping")]

    def on_delta(d: Choice, c: Choice) -> list[str]:
        return start(c) + writer.feed(d.parsed)

    def last(choices: list[Choice]) -> list[str]:
        reason, seq = _stop_reason(st, choices[0], body)
        end = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
               "usage": _usage(len(spec.prompt_ids), choices[0])}
        return (start(choices[0]) + writer.close()
                + [sse(end, "message_delta"), sse({"type": "message_stop"}, "message_stop")])

    return stream(st, [spec], "/v1/messages", [], on_delta, last)


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.arguments_dict()}


def _blocks(parsed: Parsed) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content or not (blocks or parsed.tool_calls):
        blocks.append({"type": "text", "text": parsed.content})
    blocks.extend(_tool_use(t) for t in parsed.tool_calls)
    return blocks


def _stop_string_hit(state: ServerState, choice: Choice, stops: list[str]) -> str | None:
    """The stop string that ended a choice (None when it ended otherwise)."""
    if choice.finish_reason != "stop" or not stops:
        return None
    full = state.decode(choice.token_ids)
    return next((s for s in stops if full.startswith(s, len(choice.text))), None)


def _stop_reason(st: ServerState, c: Choice, body: AMessagesRequest) -> tuple[str, str | None]:
    finish = c.api_finish
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    hit = _stop_string_hit(st, c, list(body.stop_sequences or []))
    return ("stop_sequence", hit) if hit is not None else ("end_turn", None)


def _usage(prompt_len: int, c: Choice) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt tokens the prefix cache did not serve."""
    cached = c.cached_tokens
    return {"input_tokens": prompt_len - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": len(c.token_ids)}


# block kind -> (its content_block_start, its delta type and text field)
_TEXT_BLOCKS = {"thinking": ({"type": "thinking", "thinking": "", "signature": ""}, "thinking_delta", "thinking"),
                "text": ({"type": "text", "text": ""}, "text_delta", "text")}


class _BlockWriter:
    """Opens, feeds and closes content blocks as the kind of output changes."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def feed(self, parsed: Parsed) -> list[str]:
        events: list[str] = []
        for kind, text in (("thinking", parsed.reasoning), ("text", parsed.content)):
            if text:
                start, delta_type, key = _TEXT_BLOCKS[kind]
                if self.kind != kind:
                    events += self._open(kind, start)
                events.append(self._delta({"type": delta_type, key: text}))
        for call in parsed.tool_calls:
            block = _tool_use(call)
            events += self._open("tool_use", {**block, "input": {}})
            events.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
        return events

    def _open(self, kind: str, start: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.kind = kind
        events.append(sse({"type": "content_block_start", "index": self.index, "content_block": start},
                          "content_block_start"))
        return events

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        events.append(sse({"type": "content_block_stop", "index": self.index}, "content_block_stop"))
        self.kind = None
        return events
