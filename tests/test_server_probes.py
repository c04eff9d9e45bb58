"""Hostile and careless requests: each gets a 4xx in its API's error shape naming the field, the
reason is logged, and the server keeps serving. Limits come from ServerConfig."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")

from ferryman.server import ServerConfig  # noqa: E402
from server_harness import LiveServer, ScriptedLogits, start_server  # noqa: E402

USER = [{"role": "user", "content": "hi"}]
CFG = ServerConfig(served_model_names=["tiny"], max_pending=4, max_tokens_default=5, max_stop_strings=8,
                   max_stop_bytes=64)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}}}}
BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "strin"}}}


@pytest.fixture(scope="module")
def srv(tiny_model) -> Iterator[LiveServer]:
    s = start_server(str(tiny_model), CFG)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(srv: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(srv: LiveServer) -> "openai.OpenAI":
    return openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)


def _healthy(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def _openai_error(r: httpx.Response, status: int, param: str) -> dict[str, Any]:
    err = r.json()["error"]
    assert r.status_code == status and err["param"] == param, r.text
    assert err["type"] == "invalid_request_error" and (err["code"] is None or isinstance(err["code"], str))
    return err


def _chat(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 4, **fields})


# ---- context overflow --------------------------------------------------------------------------
def test_context_overflow_openai_wording(client, http: httpx.Client) -> None:
    long = [{"role": "user", "content": "word " * 700}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=long, max_tokens=4)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert re.match(r"This model's maximum context length is 512 tokens\. However, your messages resulted in "
                    r"\d+ tokens", err["message"]), err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=list(range(10, 522)), max_tokens=4)  # 512: no room left
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    assert "maximum context length is 512 tokens" in e.value.body["message"] and "512 tokens" in e.value.body["message"]
    _healthy(http)


def test_context_overflow_anthropic_wording(srv: LiveServer, http: httpx.Client) -> None:
    a = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "word " * 700}])
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    m = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", body["error"]["message"])
    assert m is not None and int(m.group(1)) > int(m.group(2)) == 511
    _healthy(http)


def test_error_code_is_never_the_status(http: httpx.Client) -> None:
    for r in (_chat(http, model="nope"), _chat(http, temperature=9), http.post("/v1/chat/completions", json={}),
              http.post("/v1/nowhere", json={})):
        code = r.json()["error"]["code"]
        assert r.status_code >= 400 and (code is None or isinstance(code, str)), r.text


# ---- logit_bias --------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [{"abc": 1}, {"-3": 1}, {"1.5": 1}, {"99999": 1}, {"5": 101}, {"5": -100.5},
                                  {"5": "x"}, {"5": True}, {"5": None}])
def test_logit_bias_garbage(http: httpx.Client, caplog: pytest.LogCaptureFixture, bias: dict) -> None:
    with caplog.at_level(logging.INFO, logger="ferryman.server"):
        r = _chat(http, logit_bias=bias)
    _openai_error(r, 400, "logit_bias")
    assert any("[logit_bias]" in rec.getMessage() for rec in caplog.records)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "logit_bias": bias})
    _openai_error(r, 400, "logit_bias")
    _healthy(http)


def test_logit_bias_steers_sampling(srv: LiveServer, client) -> None:
    tok = srv.loop.engine.tokenizer
    kw = dict(model="tiny", prompt="a b c", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    free = client.completions.create(**kw, logprobs=1)
    forced = client.completions.create(**kw, logit_bias={"1234": 100})
    assert forced.choices[0].text == tok.decode([1234] * 3)
    first = tok.encode(free.choices[0].logprobs.tokens[0], add_special_tokens=False)[0]
    banned = client.completions.create(**kw, logprobs=1, logit_bias={str(first): -100})
    assert banned.choices[0].logprobs.tokens[0] != free.choices[0].logprobs.tokens[0]


# ---- tool schemas ------------------------------------------------------------------------------
def test_invalid_tool_schema_names_the_tool(http: httpx.Client) -> None:
    bad = {"type": "function", "function": {"name": "broken", "parameters": BAD_SCHEMA}}
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "broken"}}):
        extra = {} if choice is None else {"tool_choice": choice}
        err = _openai_error(_chat(http, tools=[WEATHER, bad], **extra), 400, "tools[1].function.parameters")
        assert "strin" in err["message"]
    r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": USER, "tools": [
        {"name": "ok", "input_schema": {"type": "object"}}, {"name": "broken", "input_schema": BAD_SCHEMA}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "tools[1].input_schema" in r.json()["error"]["message"]
    _healthy(http)


def test_schema_compiled_once_per_request(srv: LiveServer, http: httpx.Client) -> None:
    grammars = srv.app.state.ferryman.grammars
    calls: list[str] = []
    compile_ = grammars.compile
    grammars.compile = lambda schema, param, **kw: calls.append(param) or compile_(schema, param, **kw)
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}
        assert _chat(http, n=3, response_format=fmt, max_tokens=8).status_code == 200
        assert _chat(http, n=3, tools=[WEATHER], tool_choice="required", max_tokens=8).status_code == 200
    finally:
        del grammars.compile
    assert calls == ["response_format", "tools"]


# ---- structured output that fails while generating ---------------------------------------------
@contextmanager
def _after_grammar(srv: LiveServer, proc: Any) -> Iterator[None]:
    """`proc` runs after the request's own processors (its grammar): it can pick what the grammar
    forbids, as a matcher that went wrong would let through."""
    loop = srv.loop
    submit = loop.submit
    loop.submit = lambda ids, p: submit(ids, dataclasses.replace(p, logits_processors=[*p.logits_processors, proc]))
    try:
        yield
    finally:
        del loop.submit


def test_grammar_failure_is_an_error(srv: LiveServer, http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}
    script = srv.loop.engine.tokenizer.encode("not json at all", add_special_tokens=False)
    with caplog.at_level(logging.INFO, logger="ferryman.server"), _after_grammar(srv, ScriptedLogits(script)):
        r = _chat(http, response_format=fmt, max_tokens=20)
        streamed = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 20,
                                                           "response_format": fmt, "stream": True}).text
    err = _openai_error(r, 400, "response_format")
    assert "structured output failed" in err["message"]
    events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["param"] == "response_format"
    assert any(rec.levelno == logging.WARNING and "response_format" in rec.getMessage() for rec in caplog.records)
    _healthy(http)


# ---- stop strings, n, max_tokens -----------------------------------------------------------------
def test_stop_string_limits(http: httpx.Client) -> None:
    _openai_error(_chat(http, stop=[f"s{i}" for i in range(9)]), 400, "stop")  # limit 8
    _openai_error(_chat(http, stop=["x" * 40, "y" * 40]), 400, "stop")  # 80 bytes > 64
    _openai_error(_chat(http, stop=["ok", ""]), 400, "stop")  # SamplingParams names it, not the message text
    assert _chat(http, stop=[f"s{i}" for i in range(8)]).status_code == 200
    r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": USER,
                                        "stop_sequences": [f"s{i}" for i in range(9)]})
    assert r.status_code == 400 and "stop_sequences" in r.json()["error"]["message"]
    _healthy(http)


def test_n_beyond_the_queue_is_400_not_429(http: httpx.Client) -> None:
    _openai_error(_chat(http, n=5), 400, "n")  # max_pending 4: a 429 would never clear
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
    _openai_error(r, 400, "n")
    _healthy(http)


def test_max_tokens_default_and_clamp(client) -> None:
    r = client.chat.completions.create(model="tiny", messages=USER, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"  # the server's default
    r = client.completions.create(model="tiny", prompt=list(range(10, 500)), max_tokens=32000,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 512 - 490 and r.choices[0].finish_reason == "length"  # clamped


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
     '"function", "function": {"name": "f", "description": "\\udfff"}}]}', "tools[0].function.description"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\ud800"]}', "prompt[1]"),
    ("/v1/messages", '{"model": "tiny", "max_tokens": 4, "system": "\\ud800", "messages": [{"role": "user", '
     '"content": "hi"}]}', "system"),
])
def test_lone_surrogate_is_400(http: httpx.Client, route: str, body: str, param: str) -> None:
    r = http.post(route, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    if route == "/v1/messages":
        assert r.json()["error"]["type"] == "invalid_request_error" and param in r.json()["error"]["message"]
    else:
        _openai_error(r, 400, param)
    _healthy(http)
