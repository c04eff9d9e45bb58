"""One API request -> n engine requests -> parsed choices, whole or streamed.

Both APIs describe a generation as a `GenSpec` (prompt, sampling, grammar, parser) and read back
`Choice`s, whole or as one delta per engine step. Aborts: a client that disconnects (streaming:
the response generator is closed; whole: a watcher polls the connection) aborts every engine
request of the API request, which frees their KV blocks before the next engine step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from ferryman.engine.outputs import RequestMetrics, TokenLogprobs
from ferryman.errors import EngineDeadError, InvalidParameterError, PromptTooLongError
from ferryman.sampling_params import SamplingParams
from ferryman.server.engine_loop import OverloadedError, RequestHandle
from ferryman.server.errors import APIError, context_overflow, is_anthropic_path, log_error
from ferryman.server.grammar import GrammarMatcher
from ferryman.server.parsers import OutputParser, Parsed, PlainParser
from ferryman.server.state import ServerState

_DISCONNECT_POLL_S = 0.25
log = logging.getLogger("ferryman.server")


@dataclass
class GenSpec:
    """One prompt's generation; its n choices get consecutive choice indexes."""

    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    grammar: Callable[[], GrammarMatcher] | None = None  # a fresh matcher per choice
    parser: Callable[[], OutputParser] = PlainParser  # a fresh parser per choice


@dataclass
class Choice:
    """A choice so far, or what one engine step added to it (a delta)."""

    index: int
    parsed: Parsed = field(default_factory=Parsed)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None  # engine reason at the end: stop | length | abort
    metrics: RequestMetrics = field(default_factory=RequestMetrics)  # final once finish_reason is set
    cached_tokens: int = 0  # prompt tokens the prefix cache served (known from the first delta)

    def add(self, d: Choice) -> None:
        self.parsed.extend(d.parsed)
        self.token_ids += d.token_ids
        self.text += d.text
        self.logprobs += d.logprobs
        self.cached_tokens = max(self.cached_tokens, d.cached_tokens)
        if d.finish_reason is not None:
            self.finish_reason, self.metrics = d.finish_reason, d.metrics

    @property
    def api_finish(self) -> str | None:
        """stop | length | tool_calls (OpenAI's names), None while running. Honest: an output cut
        by max_tokens inside a tool call, or with no whole call, is "length", never "tool_calls"."""
        if self.finish_reason is None:
            return None
        calls = bool(self.parsed.tool_calls)
        if self.finish_reason == "length" and (self.parsed.cut_call or not calls):
            return "length"
        return "tool_calls" if calls else "stop"


@dataclass
class _Sub:
    """One submitted choice: its engine request, its output parser, its grammar (if any)."""

    handle: RequestHandle
    parser: OutputParser
    grammar: GrammarMatcher | None


def make_params(api_names: dict[str, str] | None = None, **kwargs: Any) -> SamplingParams:
    """SamplingParams, or a 400 naming the bad field: the field SamplingParams names, under its
    request name where it differs (`api_names`: {"max_tokens": "max_completion_tokens", ...})."""
    try:
        return SamplingParams(**kwargs)
    except InvalidParameterError as e:
        raise APIError(400, str(e), (api_names or {}).get(e.param, e.param)) from None


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def choice_params(spec: GenSpec, i: int) -> tuple[SamplingParams, GrammarMatcher | None]:
    """Choice i of n: the spec's params with seed + i (seeded choices differ but are reproducible)
    and a fresh grammar matcher among its logits processors (returned too)."""
    params = spec.params
    if params.seed is not None and i > 0:
        params = dataclasses.replace(params, seed=(params.seed + i) % 2**63)
    if spec.grammar is None:
        return params, None
    matcher = spec.grammar()
    return dataclasses.replace(params, logits_processors=[*params.logits_processors, matcher]), matcher


def _submit(state: ServerState, specs: list[GenSpec]) -> list[_Sub]:
    """Submit every choice of every spec (choice index = position in the returned list)."""
    state.check_room(sum(spec.n for spec in specs))  # never fits: a 400, not a 429
    subs: list[_Sub] = []
    try:
        for spec in specs:
            for i in range(spec.n):
                params, matcher = choice_params(spec, i)
                subs.append(_Sub(state.loop.submit(spec.prompt_ids, params), spec.parser(), matcher))
    except (OverloadedError, EngineDeadError) as e:
        _abort(state, subs)
        raise engine_error(e) from None
    return subs


def _abort(state: ServerState, subs: list[_Sub]) -> None:
    for sub in subs:
        state.loop.abort(sub.handle)


def _whole_calls(parsed: Parsed) -> Parsed:
    """Only whole calls are returned as calls; one whose arguments are not a JSON object is
    dropped and flagged (`cut_call`), so no finish reason claims it."""
    cut = [c.name for c in parsed.tool_calls if not c.complete]
    if cut:
        parsed.tool_calls = [c for c in parsed.tool_calls if c.complete]
        parsed.cut_call = True
        log.info("tool call(s) %s not returned: their arguments are not a whole JSON object", ", ".join(cut))
    return parsed


def _grammar_failed(matcher: GrammarMatcher) -> APIError:
    return APIError(400, f"{matcher.param}: structured output failed while generating ({matcher.error}); "
                         "the output would not match the schema", matcher.param)


async def _choice_deltas(index: int, sub: _Sub, out: asyncio.Queue) -> None:
    """Pump one engine request's events, parsed, into `out`; the last item is None or an error
    (a grammar that failed makes the request's end an error, not an output off its schema)."""
    handle, parser = sub.handle, sub.parser
    try:
        async for ev in handle.events():
            parsed = parser.feed(ev.token_ids, ev.text)
            metrics = RequestMetrics()
            if ev.finish_reason is not None:
                if sub.grammar is not None and sub.grammar.error is not None:
                    raise _grammar_failed(sub.grammar)
                parsed.extend(parser.finish())
                metrics = handle.output.metrics if handle.output is not None else metrics
            await out.put(Choice(index, _whole_calls(parsed), ev.token_ids, ev.text, ev.logprobs,
                                 ev.finish_reason, metrics, ev.num_cached_tokens))
        await out.put(None)
    except Exception as e:  # noqa: BLE001 - handed to the consumer
        await out.put(e)


async def _drain(state: ServerState, subs: list[_Sub]) -> AsyncIterator[Choice]:
    """Deltas of all choices, interleaved as they come; closing it aborts them all."""
    out: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_choice_deltas(i, sub, out)) for i, sub in enumerate(subs)]
    done = 0
    try:
        while done < len(tasks):
            item = await out.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        _abort(state, subs)
        for t in tasks:
            t.cancel()


async def _watch_disconnect(request: Request, on_gone: Callable[[], None]) -> None:
    while True:
        await asyncio.sleep(_DISCONNECT_POLL_S)
        if await request.is_disconnected():
            on_gone()
            return


async def generate(state: ServerState, specs: list[GenSpec], request: Request) -> list[Choice]:
    """Run all choices to the end; the client leaving aborts them (they end with "abort")."""
    subs = _submit(state, specs)
    choices = [Choice(i) for i in range(len(subs))]
    watcher = asyncio.create_task(_watch_disconnect(request, lambda: _abort(state, subs)))
    deltas = _drain(state, subs)
    try:
        async for d in deltas:
            choices[d.index].add(d)
    except Exception as e:
        raise engine_error(e) from None
    finally:
        watcher.cancel()
        await deltas.aclose()
    return choices


def stream(state: ServerState, specs: list[GenSpec], path: str, first: list[str],
           on_delta: Callable[[Choice, Choice], list[str]],
           last: Callable[[list[Choice]], list[str]],
           on_error: Callable[[APIError], list[str]] | None = None) -> StreamingResponse:
    """Server-sent events: `first`, each delta's `on_delta(delta, its choice so far)`, then
    `last(choices)`. Submits at once, so a 429 / 503 is an HTTP error before the stream starts;
    a failure mid-stream ends it with `on_error(error)`, by default an error event in the style
    of the API at `path`."""
    deltas = _drain(state, _submit(state, specs))
    choices = [Choice(i) for i in range(sum(s.n for s in specs))]

    async def events() -> AsyncIterator[str]:
        for ev in first:
            yield ev
        try:
            async for d in deltas:
                choices[d.index].add(d)
                for ev in on_delta(d, choices[d.index]):
                    yield ev
        except Exception as e:  # the engine died or a request failed
            err = engine_error(e)
            log_error(path, err)
            if on_error is not None:
                for ev in on_error(err):
                    yield ev
                return
            yield sse(err.body(path), "error" if is_anthropic_path(path) else None)
            if path in ("/v1/chat/completions", "/v1/completions"):  # their clients wait for [DONE]
                yield "data: [DONE]\n\n"
            return
        finally:
            await deltas.aclose()  # a client gone closes this generator: abort its requests
        for ev in last(choices):
            yield ev

    return StreamingResponse(events(), media_type="text/event-stream")


def engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, OverloadedError):
        return APIError(429, str(e), headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e))
    if isinstance(e, PromptTooLongError):
        return context_overflow(e.prompt_len, e.max_len, "messages")
    if isinstance(e, InvalidParameterError):
        return APIError(400, str(e), e.param)
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f"{type(e).__name__}: {e}")
