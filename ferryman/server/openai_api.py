"""OpenAI API: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

from ferryman.engine.outputs import TokenLogprobs
from ferryman.sampling_params import SamplingParams
from ferryman.server.errors import APIError
from ferryman.server.generation import Choice, GenSpec, generate, make_params, sse, stream
from ferryman.server.limits import check_stops, check_unicode, logit_bias
from ferryman.server.parsers import Parsed
from ferryman.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from ferryman.server.state import ServerState
from ferryman.server.tooling import ToolSetup, tool_setup

router = APIRouter()
COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's default) unless the server sets one


def sampling_params(st: ServerState, req: Any, max_tokens: int, top_logprobs: int | None,
                    api_names: dict[str, str] | None = None, message_ends: list[int] | None = None) -> SamplingParams:
    """The request's SamplingParams; a 400 names the request's field (`api_names` maps the
    SamplingParams field to it where the names differ)."""
    stop = check_stops([req.stop] if isinstance(req.stop, str) else list(req.stop or []), st.cfg, "stop")
    return make_params(api_names, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                       seed=req.seed, repetition_penalty=req.repetition_penalty,
                       presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                       stop=stop, max_tokens=max_tokens, ignore_eos=req.ignore_eos, logprobs=top_logprobs,
                       logits_processors=logit_bias(req.logit_bias, st.vocab_size), message_ends=message_ends or [])


def usage(prompt_len: int, choices: list[Choice]) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in choices)
    cached = max((c.metrics.num_cached_tokens for c in choices), default=0)
    return {"prompt_tokens": prompt_len, "completion_tokens": completion,
            "total_tokens": prompt_len + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def _head(prefix: str, obj: str, model: str) -> dict[str, Any]:
    return {"id": prefix + uuid.uuid4().hex, "object": obj, "created": int(time.time()), "model": model}


def _stream_end(body: ChatCompletionRequest | CompletionRequest, head: dict[str, Any],
                prompt_len: int) -> Callable[[list[Choice]], list[str]]:
    """The usage chunk (when asked for) and [DONE]."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def end(choices: list[Choice]) -> list[str]:
        tail = [sse({**head, "choices": [], "usage": usage(prompt_len, choices)})] if include_usage else []
        return tail + ["data: [DONE]\n\n"]

    return end


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    st: ServerState = request.app.state.ferryman
    data = [{"id": n, "object": "model", "created": st.created, "owned_by": "ferryman",
             "max_model_len": st.max_model_len} for n in st.model_names]
    return {"object": "list", "data": data}


# ---- chat ------------------------------------------------------------------------------------
def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Request messages -> template dicts (text content, developer = system)."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": c.function.model_dump()}
                               for c in m.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(m, key):
                d[key] = getattr(m, key)
        out.append(d)
    return out


def _chat_tools(st: ServerState, body: ChatCompletionRequest) -> ToolSetup:
    tools = [t.model_dump() for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = "function:" + choice.function.name
    fmt = body.response_format
    schema = None
    if fmt is not None and fmt.type == "json_object":
        schema = {"type": "object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format.json_schema is required for type json_schema",
                           "response_format.json_schema")
        schema = fmt.json_schema.schema_
    return tool_setup(st, tools, choice, schema)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    st: ServerState = request.app.state.ferryman
    st.check_model(body.model)
    check_unicode(body)
    tools = _chat_tools(st, body)
    prompt = await st.chat_prompt(chat_messages(body.messages), tools.tools, body.chat_template_kwargs,
                                  body.chat_template)
    st.check_prompt(prompt.token_ids, "messages")
    wanted = body.max_completion_tokens or body.max_tokens
    top = (body.top_logprobs or 0) if body.logprobs else None
    names = {"max_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
             "logprobs": "top_logprobs"}
    params = sampling_params(st, body, st.max_tokens(wanted, len(prompt.token_ids)), top, names, prompt.message_ends)
    spec = GenSpec(prompt.token_ids, params, body.n, tools.grammar, tools.parser_factory(prompt))
    if body.stream:
        head = _head("chatcmpl-", "chat.completion.chunk", body.model)
        first = [sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]}) for i in range(spec.n)]

        def on_delta(d: Choice, choice: Choice) -> list[str]:
            chunk = _chat_chunk(st, d, choice, top is not None)
            return [] if chunk is None else [sse({**head, "choices": [chunk]})]

        return stream(st, [spec], "/v1/chat/completions", first, on_delta,
                      _stream_end(body, head, len(prompt.token_ids)))
    choices = await generate(st, [spec], request)
    return {**_head("chatcmpl-", "chat.completion", body.model),
            "choices": [_chat_choice(st, c, top is not None) for c in choices],
            "usage": usage(len(prompt.token_ids), choices)}


def _message_fields(parsed: Parsed, first_call: int | None) -> dict[str, Any]:
    """The content, reasoning and tool calls `parsed` has; streamed calls carry their index (from
    `first_call`) among the choice's calls."""
    out: dict[str, Any] = {}
    if parsed.content:
        out["content"] = parsed.content
    if parsed.reasoning:
        out["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in parsed.tool_calls]
        if first_call is not None:
            calls = [{"index": first_call + i, **call} for i, call in enumerate(calls)]
        out["tool_calls"] = calls
    return out


def _chat_choice(st: ServerState, c: Choice, logprobs: bool) -> dict[str, Any]:
    calls = bool(c.parsed.tool_calls)
    msg = {"role": "assistant", "content": None if calls else "", **_message_fields(c.parsed, None)}
    return {"index": c.index, "message": msg, "finish_reason": c.api_finish,
            "logprobs": {"content": chat_logprobs(st, c.token_ids, c.logprobs)} if logprobs else None}


def _chat_chunk(st: ServerState, d: Choice, choice: Choice, logprobs: bool) -> dict[str, Any] | None:
    """The chunk of delta `d` of `choice` (which already includes it); None when it has nothing."""
    delta = _message_fields(d.parsed, len(choice.parsed.tool_calls) - len(d.parsed.tool_calls))
    if not delta and d.finish_reason is None:
        return None
    return {"index": d.index, "delta": delta,
            "logprobs": {"content": chat_logprobs(st, d.token_ids, d.logprobs)} if logprobs else None,
            "finish_reason": choice.api_finish}


def _logprob_entry(st: ServerState, token_id: int, lp: float) -> dict[str, Any]:
    text = st.token_text(token_id)
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(st: ServerState, ids: list[int], lps: list[TokenLogprobs | None]) -> list[dict[str, Any]]:
    return [{**_logprob_entry(st, t, lp[0]), "top_logprobs": [_logprob_entry(st, i, v) for i, v in lp[1]]}
            for t, lp in zip(ids, lps) if lp is not None]


# ---- completions ------------------------------------------------------------------------------
async def _prompts(st: ServerState, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await st.encode_prompt(prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [await st.encode_prompt(p, f"prompt[{i}]") if isinstance(p, str) else list(p)  # type: ignore[union-attr]
            for i, p in enumerate(prompt)]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    st: ServerState = request.app.state.ferryman
    st.check_model(body.model)
    check_unicode(body)
    if body.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported (no prompt logprobs)", "echo")
    prompts = await _prompts(st, body.prompt)
    specs = []
    wanted = body.max_tokens or st.cfg.max_tokens_default or COMPLETION_MAX_TOKENS
    for ids in prompts:
        st.check_prompt(ids, "prompt")
        specs.append(GenSpec(ids, sampling_params(st, body, st.max_tokens(wanted, len(ids)), body.logprobs), body.n))
    echo = [st.decode(ids) if body.echo else "" for ids in prompts for _ in range(body.n)]
    prompt_len = sum(len(p) for p in prompts)
    logprobs = body.logprobs is not None
    head = _head("cmpl-", "text_completion", body.model)
    if body.stream:
        def on_delta(d: Choice, _: Choice) -> list[str]:
            prefix, echo[d.index] = echo[d.index], ""  # the echo goes with the first chunk
            if not (d.text or d.finish_reason is not None or prefix):
                return []
            return [sse({**head, "choices": [_completion_choice(st, d, prefix + d.text, logprobs)]})]

        return stream(st, specs, "/v1/completions", [], on_delta, _stream_end(body, head, prompt_len))
    choices = await generate(st, specs, request)
    return {**head, "choices": [_completion_choice(st, c, echo[c.index] + c.text, logprobs) for c in choices],
            "usage": usage(prompt_len, choices)}


def completion_logprobs(st: ServerState, ids: list[int], lps: list[TokenLogprobs | None]) -> dict[str, Any]:
    tokens = [st.token_text(t) for t in ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens), initial=0))[:-1]
    return {"tokens": tokens, "token_logprobs": [lp[0] if lp else None for lp in lps],
            "top_logprobs": [{st.token_text(i): v for i, v in lp[1]} if lp else None for lp in lps],
            "text_offset": offsets}


def _completion_choice(st: ServerState, c: Choice, text: str, logprobs: bool) -> dict[str, Any]:
    return {"index": c.index, "text": text,
            "logprobs": completion_logprobs(st, c.token_ids, c.logprobs) if logprobs else None,
            "finish_reason": c.api_finish}
