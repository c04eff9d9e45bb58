"""OpenAI Responses API: POST /v1/responses, whole and streamed (what Codex CLI speaks).

The request becomes chat messages and tools (responses_protocol.py), rendered by the chat
template and generated like a chat completion (tooling, generation, the reasoning / tool-call
parsers); the parsed output becomes output items (responses_output.py).

Stateless: nothing is stored, so `store` changes nothing, and what needs a stored response
(`previous_response_id`, `conversation`, `background`, stored `prompt` templates) is a 400.
A stream is: response.created, response.in_progress, the items' events, then response.completed
(response.incomplete when max_output_tokens cut the output; response.failed on an engine error).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request

from ferryman.server.errors import APIError
from ferryman.server.generation import Choice, GenSpec, generate, make_params, stream
from ferryman.server.responses_output import OutputWriter
from ferryman.server.responses_protocol import (ResponsesRequest, conversation, function_tools, json_schema,
                                                tool_choice)
from ferryman.server.state import ServerState
from ferryman.server.tooling import tool_setup

router = APIRouter()

_STATEFUL = {"previous_response_id": "previous_response_id", "conversation": "conversation",
             "background": "background", "prompt": "prompt (a stored prompt template)"}


def _refuse_stateful(body: ResponsesRequest) -> None:
    for field, what in _STATEFUL.items():
        if getattr(body, field):
            raise APIError(400, f"{what} is not supported: this server stores no responses; send the "
                                "whole conversation in `input` (with store: false)", field)


def _template_kwargs(body: ResponsesRequest) -> dict[str, Any] | None:
    """reasoning.effort for the chat template: gpt-oss reads `reasoning_effort`, Qwen3
    `enable_thinking` (off for effort none / minimal)."""
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is None:
        return None
    if effort in ("none", "minimal"):
        return {"enable_thinking": False, "reasoning_effort": "low"}
    return {"reasoning_effort": "high" if effort == "xhigh" else effort}


def _head(body: ResponsesRequest) -> dict[str, Any]:
    """The Response object's fields that do not depend on the output."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    return {"id": "resp_" + uuid.uuid4().hex, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": body.model, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
            "temperature": body.temperature, "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                                                if fmt is not None else {"type": "text"}},
            "truncation": "disabled", "metadata": body.metadata or {}, "user": body.user, "usage": None}


def _usage(st: ServerState, prompt_len: int, c: Choice) -> dict[str, Any]:
    text = c.parsed.reasoning
    reasoning = len(st.tokenizer.encode(text, add_special_tokens=False)) if text and st.tokenizer is not None else 0
    out = len(c.token_ids)
    # the prefix cache fills itself at no charge: nothing counts as a cache write (as cache_creation_input_tokens)
    details = {"cached_tokens": c.metrics.num_cached_tokens, "cache_write_tokens": 0}
    return {"input_tokens": prompt_len, "input_tokens_details": details,
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": min(reasoning, out)},
            "total_tokens": prompt_len + out}


def _final(st: ServerState, head: dict[str, Any], writer: OutputWriter, c: Choice, prompt_len: int) -> dict[str, Any]:
    cut = c.finish_reason == "length"
    return {**head, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "completed_at": None if cut else int(time.time()), "output": writer.items,
            "usage": _usage(st, prompt_len, c)}


@router.get("/v1/responses/{response_id}")
@router.delete("/v1/responses/{response_id}")
async def stored_response(response_id: str) -> None:
    raise APIError(404, f"response '{response_id}' does not exist: this server stores no responses "
                        "(store: true is accepted and changes nothing)", "response_id")


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    st: ServerState = request.app.state.ferryman
    st.check_model(body.model)
    _refuse_stateful(body)
    tools, names = function_tools(body.tools)
    choice, tools = tool_choice(body.tool_choice, tools, names)
    setup = tool_setup(st, tools or None, choice, json_schema(body.text), format_param="text.format")
    prompt = st.renderer.render(conversation(body), setup.tools, _template_kwargs(body))
    prompt_len = len(prompt.token_ids)
    st.check_prompt(prompt.token_ids, "input")
    sampling = {k: v for k, v in (("temperature", body.temperature), ("top_p", body.top_p)) if v is not None}
    params = make_params(**sampling, max_tokens=st.max_tokens(body.max_output_tokens, prompt_len),
                         message_ends=prompt.message_ends)
    spec = GenSpec(prompt.token_ids, params, 1, setup.grammar, setup.parser_factory(prompt))
    writer = OutputWriter(names, body.parallel_tool_calls, forced_tool=setup.forced is not None)
    head = _head(body)
    if not body.stream:
        c = (await generate(st, [spec], request))[0]
        writer.feed(c.parsed, c.finish_reason)
        writer.close(c.finish_reason == "length")
        return _final(st, head, writer, c, prompt_len)
    first = [writer.event("response.created", response=head), writer.event("response.in_progress", response=head)]

    def last(choices: list[Choice]) -> list[str]:
        c = choices[0]
        events = writer.close(c.finish_reason == "length")
        final = _final(st, head, writer, c, prompt_len)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return events + [writer.event(kind, response=final)]

    def failed(err: APIError) -> list[str]:
        code = "rate_limit_exceeded" if err.status == 429 else "server_error"
        events = writer.close(True)
        response = {**head, "status": "failed", "output": writer.items, "error": {"code": code, "message": err.message}}
        return events + [writer.event("response.failed", response=response)]

    return stream(st, [spec], "/v1/responses", first, lambda d, _: writer.feed(d.parsed, d.finish_reason), last,
                  on_error=failed)
