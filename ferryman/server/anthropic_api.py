"""Anthropic API: /v1/messages (whole and streamed) and /v1/messages/count_tokens.

Messages are converted to the OpenAI shape and rendered by the same chat template; `tool_use`
blocks become assistant tool calls, `tool_result` blocks tool messages, reasoning comes back as
`thinking` blocks. Streams follow Anthropic's event sequence: message_start, ping, per block
content_block_start / *_delta / content_block_stop, message_delta (stop_reason, usage), message_stop.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import APIRouter, Request

from ferryman.server.chat import ChatPrompt
from ferryman.server.errors import APIError
from ferryman.server.generation import Choice, GenSpec, generate, make_params, sse, stream
from ferryman.server.parsers import Parsed, ToolCall
from ferryman.server.protocol import ACountTokensRequest, AMessage, AMessagesRequest
from ferryman.server.state import ServerState
from ferryman.server.tooling import ToolSetup, tool_setup

router = APIRouter()


def _text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _message_dicts(i: int, m: AMessage) -> list[dict[str, Any]]:
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


async def _prompt(st: ServerState, body: ACountTokensRequest) -> tuple[ChatPrompt, ToolSetup]:
    st.check_model(body.model)
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
                       format_param="output_config.format")
    kwargs = {"enable_thinking": body.thinking.type != "disabled"} if body.thinking else None
    return await st.chat_prompt(messages, setup.tools, kwargs), setup


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: ACountTokensRequest, request: Request) -> dict[str, Any]:
    prompt, _ = await _prompt(request.app.state.ferryman, body)
    return {"input_tokens": len(prompt.token_ids)}


@router.post("/v1/messages")
async def messages(body: AMessagesRequest, request: Request) -> Any:
    st: ServerState = request.app.state.ferryman
    prompt, setup = await _prompt(st, body)
    st.check_prompt(prompt.token_ids, "messages")
    params = make_params(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                         stop=list(body.stop_sequences or []),
                         max_tokens=st.max_tokens(body.max_tokens, len(prompt.token_ids)))
    spec = GenSpec(prompt.token_ids, params, 1, setup.grammar, setup.parser_factory(prompt))
    message = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": body.model}
    if body.stream:
        start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": len(spec.prompt_ids), "output_tokens": 0}}
        writer = _BlockWriter()

        def last(choices: list[Choice]) -> list[str]:
            reason, seq = _stop_reason(st, choices[0], body)
            end = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                   "usage": _usage(len(spec.prompt_ids), choices[0])}
            return writer.close() + [sse(end, "message_delta"), sse({"type": "message_stop"}, "message_stop")]

        first = [sse({"type": "message_start", "message": start}, "message_start"), sse({"type": "ping"}, "ping")]
        return stream(st, [spec], "/v1/messages", first, lambda d, _: writer.feed(d.parsed), last)
    choice = (await generate(st, [spec], request))[0]
    reason, seq = _stop_reason(st, choice, body)
    return {**message, "content": _blocks(choice.parsed), "stop_reason": reason, "stop_sequence": seq,
            "usage": _usage(len(prompt.token_ids), choice)}


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
    if c.parsed.tool_calls:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    hit = _stop_string_hit(st, c, list(body.stop_sequences or []))
    return ("stop_sequence", hit) if hit is not None else ("end_turn", None)


def _usage(prompt_len: int, c: Choice) -> dict[str, Any]:
    cached = c.metrics.num_cached_tokens
    return {"input_tokens": prompt_len - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": len(c.token_ids)}


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
