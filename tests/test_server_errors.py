"""Bad input, auth, limits, overload and client disconnects: status codes and error objects."""

from __future__ import annotations

import json
import threading

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from ferryman.server import ServerConfig  # noqa: E402
from server_harness import (  # noqa: E402
    LiveServer,
    build_tiny_chat_model,
    delay_steps,
    start_server,
    wait_until,
)

KEY = "s3cret"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    cfg = ServerConfig(served_model_names=["tiny"], api_key=KEY, max_body_bytes=8192, max_pending=2)
    srv = start_server(str(folder), cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server: LiveServer) -> httpx.Client:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        yield c


@pytest.fixture
def slow(server: LiveServer):
    """Every engine step takes 50 ms while the test runs (requests stay in flight)."""
    delay_steps(server, 0.05)
    yield
    delay_steps(server, 0.0)


def _stats(http: httpx.Client) -> dict:
    return http.get("/v1/stats").json()


def test_malformed_json(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    assert "JSON" in r.json()["error"]["message"]
    r = http.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "messages": USER, "temperature": 5}, "temperature"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "tiny"}, "messages"),
    ({"model": "tiny", "messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "messages": USER, "n": "many"}, "n"),
    ({"model": "tiny", "messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"model": "tiny", "messages": USER, "tool_choice": "required"}, "tool_choice"),
])
def test_invalid_field_names_it(http: httpx.Client, body: dict, param: str) -> None:
    r = http.post("/v1/chat/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and param in err["message"]
    assert err["type"] == "invalid_request_error"


def test_unknown_model_and_route(server: LiveServer, http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="gpt-17"):
        client.chat.completions.create(model="gpt-17", messages=USER)
    assert http.post("/v1/nothing", json={}).status_code == 404


def test_prompt_over_context(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    ids = list(range(10, 610))  # 600 tokens > max_model_len 512
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=ids, max_tokens=4)
    assert "600" in e.value.message and "512" in e.value.message


def test_body_too_large(http: httpx.Client) -> None:
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 10000}]}
    r = http.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and "8192" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield json.dumps(big).encode()

    r = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = http.post("/v1/messages", json={**big, "max_tokens": 4})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_api_key(server: LiveServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    r = httpx.post(server.url + "/v1/messages", json={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def test_overload_429_then_disconnect_frees_blocks(server: LiveServer, http: httpx.Client, slow) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=30)
    streams = [client.chat.completions.create(model="tiny", messages=USER, max_tokens=400, stream=True)
               for _ in range(2)]
    for s in streams:
        next(iter(s))  # both are running
    wait_until(lambda: _stats(http)["num_running"] == 2, what="2 running")
    assert _stats(http)["kv_usage"] > 0
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
    assert e.value.response.headers["retry-after"] == "1"
    for s in streams:
        s.close()  # the clients go away mid-stream
    took = wait_until(lambda: _stats(http)["requests_in_flight"] == 0, what="aborted requests gone")
    stats = _stats(http)
    assert stats["num_running"] == 0 and stats["kv_usage"] == 0.0 and took < 2.0


def test_non_streaming_disconnect_aborts(server: LiveServer, http: httpx.Client, slow) -> None:
    def impatient() -> None:
        # long enough for the stats (refreshed every 0.2 s) to show it running on a loaded 2-core CI machine
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", headers={"x-api-key": KEY}, timeout=1.5,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 400})

    t = threading.Thread(target=impatient)
    t.start()
    wait_until(lambda: _stats(http)["num_running"] == 1, what="request running")
    t.join(5)
    wait_until(lambda: _stats(http)["requests_in_flight"] == 0, timeout_s=2.0, what="abort after disconnect")
    assert _stats(http)["kv_usage"] == 0.0
