"""Hostile requests: each gets a 4xx in its API's error shape, at once, the server stays healthy
and its event loop never stalls (a /health ping runs alongside every probe)."""

from __future__ import annotations

import json
import logging
import resource
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from ferryman.server import ServerConfig  # noqa: E402
from server_harness import LiveServer, delay_steps, start_server, wait_until  # noqa: E402

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "hi"}]
STALL_S = 1.0  # the longest a /health ping may take while a bad request is handled


@pytest.fixture(scope="module")
def strict(tiny_model: Path) -> Iterator[LiveServer]:
    """Defaults as served, with a key, a small queue and a short body timeout."""
    cfg = ServerConfig(served_model_names=["tiny"], api_key=KEY, max_pending=4, body_timeout_s=1.0)
    srv = start_server(str(tiny_model), cfg)
    _warm(srv)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def trusting(tiny_model: Path) -> Iterator[LiveServer]:
    """Takes client chat templates (1 s each) and prompts of up to 3M characters."""
    cfg = ServerConfig(served_model_names=["tiny"], trust_request_chat_template=True, template_timeout_s=1.0,
                       max_prompt_chars=3_000_000)
    srv = start_server(str(tiny_model), cfg)
    _warm(srv)
    yield srv
    srv.stop()


def _warm(server: LiveServer) -> None:
    """Two requests at once: each prompt worker makes its tokenizer copy before a test times one."""
    threads = [threading.Thread(target=_chat, args=(server, {"messages": USER}, AUTH)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


@contextmanager
def health_pings(server: LiveServer) -> Iterator[list[float]]:
    """Ping /health every 20 ms while the block runs; the list gets each ping's latency. After the
    block: the server answered every ping 200 and none took STALL_S or more."""
    latencies: list[float] = []
    statuses: list[int] = []
    stop = threading.Event()

    def ping() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                statuses.append(c.get(server.url + "/health").status_code)
                latencies.append(time.monotonic() - t0)
                time.sleep(0.02)

    t = threading.Thread(target=ping)
    t.start()
    time.sleep(0.05)
    try:
        yield latencies
    finally:
        stop.set()
        t.join(30)
    assert statuses and set(statuses) == {200}, statuses
    assert max(latencies) < STALL_S, f"the event loop stalled: a /health ping took {max(latencies):.2f} s"


def _chat(server: LiveServer, body: dict, headers: dict | None = None, path: str = "/v1/chat/completions",
          timeout: float = 30) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", "max_tokens": 4, **body}, headers=headers,
                      timeout=timeout)


def _openai_error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["param"] == param, err
    return err["message"]


def _still_serves(server: LiveServer, headers: dict | None = None) -> None:
    r = _chat(server, {"messages": USER}, headers)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


# ---- client chat templates -----------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"chat_template_kwargs": {"chat_template": "{{ 'x' * 200000000 }}"}}, "chat_template_kwargs.chat_template"),
    ({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}, "chat_template"),
])
def test_client_templates_are_refused_by_default(strict: LiveServer, body: dict, param: str) -> None:
    with health_pings(strict):
        t0 = time.monotonic()
        message = _openai_error(_chat(strict, {"messages": USER, **body}, AUTH), 400, param)
        assert time.monotonic() - t0 < 1.0
    assert "--trust-request-chat-template" in message
    _still_serves(strict, AUTH)


def test_reserved_template_kwargs_are_refused(strict: LiveServer) -> None:
    r = _chat(strict, {"messages": USER, "chat_template_kwargs": {"tokenize": True}}, AUTH)
    _openai_error(r, 400, "chat_template_kwargs.tokenize")


@pytest.mark.parametrize("template, within_s", [
    ("{{ 'x' * 200000000 }}", 1.0),  # refused before it is built (milliseconds on an idle machine)
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", 1.0),
    ("{{ 'x'|center(1000000000) }}", 1.0),
    ("{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}", 2.5),  # the deadline
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", 2.5),
])
def test_hostile_trusted_templates_fail_fast_without_memory(trusting: LiveServer, template: str,
                                                            within_s: float) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the process's peak so far
    with health_pings(trusting):
        t0 = time.monotonic()
        message = _openai_error(_chat(trusting, {"messages": USER, "chat_template": template}), 400, "chat_template")
        took = time.monotonic() - t0
    assert took < within_s, took
    assert "limit" in message or "more than 1 s" in message, message
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 200, f"the peak RSS grew by {grown_mib:.0f} MiB"
    _still_serves(trusting)


def test_a_trusted_template_renders_like_the_models_own(trusting: LiveServer) -> None:
    """The sandbox renders the demo template as transformers does: same prompt, token for token."""
    template = trusting.loop.engine.tokenizer.chat_template
    msgs = [{"role": "system", "content": "be brief"}, *USER]
    own = _chat(trusting, {"messages": msgs}).json()
    sent = _chat(trusting, {"messages": msgs, "chat_template": template}).json()
    assert sent["usage"]["prompt_tokens"] == own["usage"]["prompt_tokens"] > 0
    custom = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n{% endfor %}"
    r = _chat(trusting, {"messages": msgs, "chat_template_kwargs": {"chat_template": custom}})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] != own["usage"]["prompt_tokens"]


# ---- prompt size and text ------------------------------------------------------------------------
def test_a_7mb_prompt_is_refused_before_tokenising(strict: LiveServer) -> None:
    big = "word " * ((7 << 20) // 5)  # 7 MiB
    with health_pings(strict):
        t0 = time.monotonic()
        r = httpx.post(strict.url + "/v1/completions", json={"model": "tiny", "prompt": big, "max_tokens": 2},
                       headers=AUTH, timeout=30)
        message = _openai_error(r, 400, "prompt")
        r = _chat(strict, {"messages": [{"role": "user", "content": big}]}, AUTH)
        _openai_error(r, 400, "messages")
        assert time.monotonic() - t0 < 2.0  # two 7 MB uploads, no tokenising
    assert "characters" in message and "limit" in message


def test_long_prompts_are_tokenised_off_the_event_loop(trusting: LiveServer) -> None:
    """2.4M characters take the tokenizer seconds; /health answers throughout. The prompt is then
    too long for the context: a 400 naming it."""
    big = "hello world, this is a test. " * 80_000
    with health_pings(trusting) as pings:
        t0 = time.monotonic()
        r = httpx.post(trusting.url + "/v1/completions", json={"model": "tiny", "prompt": big, "max_tokens": 2},
                       timeout=60)
        took = time.monotonic() - t0
    _openai_error(r, 400, "prompt")
    assert len(pings) >= 5 and took > 0.3, (len(pings), took)  # the pings did run while it tokenised
    _still_serves(trusting)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages[0].content"),
    ("/v1/completions", '{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt[1]"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(strict: LiveServer, path: str, body: str, param: str) -> None:
    r = httpx.post(strict.url + path, content=body.encode(), headers={**AUTH, "content-type": "application/json"})
    assert "surrogate" in _openai_error(r, 400, param)
    _still_serves(strict, AUTH)


def test_a_lone_surrogate_on_the_anthropic_api(strict: LiveServer) -> None:
    body = '{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "\\ud800"}]}'
    r = httpx.post(strict.url + "/v1/messages", content=body.encode(),
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "surrogate" in r.json()["error"]["message"]


# ---- queue, body timeout ----------------------------------------------------------------------
def test_more_generations_than_the_queue_holds_is_a_400_not_a_429(strict: LiveServer) -> None:
    r = httpx.post(strict.url + "/v1/completions", headers=AUTH,
                   json={"model": "tiny", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
    assert "6 generations" in _openai_error(r, 400, "n") and "--max-queue" in r.json()["error"]["message"]
    r = httpx.post(strict.url + "/v1/completions", headers=AUTH,
                   json={"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_a_request_that_fits_later_gets_429_with_retry_after(strict: LiveServer) -> None:
    delay_steps(strict, 0.05)
    try:
        client = openai.OpenAI(base_url=strict.base_url, api_key=KEY, max_retries=0, timeout=30)
        streams = [client.completions.create(model="tiny", prompt="go", max_tokens=300, stream=True, n=2)
                   for _ in range(2)]
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="tiny", prompt="more", max_tokens=2)
        assert e.value.response.headers["retry-after"] == "1"
        for s in streams:
            s.close()
    finally:
        delay_steps(strict, 0.0)
    wait_until(lambda: strict.loop.num_pending == 0, what="aborted streams gone")


def test_a_trickled_body_is_cut_with_408(strict: LiveServer) -> None:
    host, port = strict.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": "hi " * 100, "max_tokens": 2}).encode()  # ~30 s trickled
    with health_pings(strict), socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        t0 = time.monotonic()
        answer = b""
        for byte in body:  # one byte every 0.1 s: the whole body would take seconds
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            sock.settimeout(0.1)
            try:
                answer += sock.recv(65536)
                break
            except TimeoutError:
                continue
        took = time.monotonic() - t0
        sock.settimeout(5)
        while answer.startswith(b"HTTP/1.1") and not answer.endswith(b"}"):  # the body may follow the headers
            more = sock.recv(65536)
            if not more:
                break
            answer += more
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"not received within 1 s" in answer and took < 8  # 1 s, and a loaded 2-core machine's slack
    _still_serves(strict, AUTH)


# ---- key, ids, logs, models ------------------------------------------------------------------------
def test_metrics_and_stats_need_the_key_health_does_not(strict: LiveServer) -> None:
    for path in ("/metrics", "/v1/stats"):
        assert httpx.get(strict.url + path).status_code == 401
        assert httpx.get(strict.url + path, headers=AUTH).status_code == 200
    assert httpx.get(strict.url + "/health").json() == {"status": "ok"}


def test_refusals_are_logged_on_one_line_with_request_id_and_field(strict: LiveServer,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ferryman.server"):
        r = _chat(strict, {"messages": USER, "temperature": "hot"}, {**AUTH, "x-request-id": "probe-42"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "probe-42"
    lines = [rec.getMessage() for rec in caplog.records if "probe-42" in rec.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "POST /v1/chat/completions -> 400" in lines[0] and "field 'temperature'" in lines[0]
    assert _chat(strict, {"messages": USER}, AUTH).headers["x-request-id"].startswith("req_")


def test_get_one_model(strict: LiveServer) -> None:
    client = openai.OpenAI(base_url=strict.base_url, api_key=KEY, max_retries=0)
    m = client.models.retrieve("tiny")
    assert (m.id, m.object, m.owned_by) == ("tiny", "model", "ferryman") and m.created > 0
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    err = e.value.response.json()["error"]
    assert "'gpt-4o' does not exist" in err["message"] and err["param"] == "model"


def test_the_watchdog_logs_what_the_engine_was_doing(tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    srv = start_server(str(tiny_model), ServerConfig(served_model_names=["tiny"], step_timeout_s=0.3))
    try:
        srv.loop.step_timeout_s = 0.3
        delay_steps(srv, 2.0)
        with caplog.at_level(logging.ERROR, logger="ferryman.server"):
            r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                           timeout=30)
        assert r.status_code == 503 and "more than 0.3 s" in r.json()["error"]["message"]
        errors = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR]
        assert any("watchdog" in m and "slow_step" in m and "1 requests in flight" in m for m in errors), errors
        assert httpx.get(srv.url + "/health").status_code == 503
    finally:
        srv.stop()
