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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from ferryman.engine.outputs import RequestMetrics, TokenLogprobs
from ferryman.errors import EngineDeadError
from ferryman.sampling_params import SamplingParams
from ferryman.server.engine_loop import OverloadedError, RequestHandle
from ferryman.server.errors import APIError, error_body, is_anthropic_path
from ferryman.server.grammar import GrammarMatcher
from ferryman.server.parsers import OutputParser, Parsed, PlainParser
from ferryman.server.state import ServerState

_DISCONNECT_POLL_S = 0.25


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

    def add(self, d: Choice) -> None:
        self.parsed.extend(d.parsed)
        self.token_ids += d.token_ids
        self.text += d.text
        self.logprobs += d.logprobs
        if d.finish_reason is not None:
            self.finish_reason, self.metrics = d.finish_reason, d.metrics


def make_params(**kwargs: Any) -> SamplingParams:
    """SamplingParams, or a 400 naming the bad field."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ")[0]) from None


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def choice_params(spec: GenSpec, i: int) -> SamplingParams:
    """Choice i of n: the spec's params with seed + i (seeded choices differ but are reproducible)
    and a fresh grammar matcher among its logits processors."""
    params = spec.params
    if params.seed is not None and i > 0:
        params = dataclasses.replace(params, seed=(params.seed + i) % 2**63)
    if spec.grammar is not None:
        params = dataclasses.replace(params, logits_processors=[*params.logits_processors, spec.grammar()])
    return params


def _submit(state: ServerState, specs: list[GenSpec]) -> list[tuple[RequestHandle, OutputParser]]:
    """Submit every choice of every spec (choice index = position in the returned list)."""
    state.check_room(sum(spec.n for spec in specs))  # never fits: a 400, not a 429
    subs: list[tuple[RequestHandle, OutputParser]] = []
    try:
        for spec in specs:
            for i in range(spec.n):
                handle = state.loop.submit(spec.prompt_ids, choice_params(spec, i))
                subs.append((handle, spec.parser()))
    except (OverloadedError, EngineDeadError) as e:
        _abort(state, subs)
        raise engine_error(e) from None
    return subs


def _abort(state: ServerState, subs: list[tuple[RequestHandle, OutputParser]]) -> None:
    for handle, _ in subs:
        state.loop.abort(handle)


async def _choice_deltas(index: int, handle: RequestHandle, parser: OutputParser, out: asyncio.Queue) -> None:
    """Pump one engine request's events, parsed, into `out`; the last item is None or an error."""
    try:
        async for ev in handle.events():
            parsed = parser.feed(ev.token_ids, ev.text)
            metrics = RequestMetrics()
            if ev.finish_reason is not None:
                parsed.extend(parser.finish())
                metrics = handle.output.metrics if handle.output is not None else metrics
            await out.put(Choice(index, parsed, ev.token_ids, ev.text, ev.logprobs, ev.finish_reason, metrics))
        await out.put(None)
    except Exception as e:  # noqa: BLE001 - handed to the consumer
        await out.put(e)


async def _drain(state: ServerState, subs: list[tuple[RequestHandle, OutputParser]]) -> AsyncIterator[Choice]:
    """Deltas of all choices, interleaved as they come; closing it aborts them all."""
    out: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_choice_deltas(i, h, p, out)) for i, (h, p) in enumerate(subs)]
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
           last: Callable[[list[Choice]], list[str]]) -> StreamingResponse:
    """Server-sent events: `first`, each delta's `on_delta(delta, its choice so far)`, then
    `last(choices)`. Submits at once, so a 429 / 503 is an HTTP error before the stream starts;
    a failure mid-stream ends it with an error event in the style of the API at `path`."""
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
            event = "error" if is_anthropic_path(path) else None
            yield sse(error_body(path, err.status, err.message, err.param), event)
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
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f"{type(e).__name__}: {e}")
