"""/health, /metrics, /v1/stats, and an engine that dies mid-stream."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from server_harness import LiveServer, delay_steps, start_server, wait_until  # noqa: E402


@pytest.fixture
def server(tiny_model: Path) -> LiveServer:
    srv = start_server(str(tiny_model))
    yield srv
    srv.stop()


def _samples(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}, parsed by prometheus_client's own parser."""
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_metrics_and_stats(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    for _ in range(2):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    m = _samples(httpx.get(server.url + "/metrics").text)
    assert m["ferryman_generation_tokens_total"] == 10
    assert m["ferryman_requests_total{route=/v1/chat/completions,status=200}"] == 2
    assert m["ferryman_time_to_first_token_seconds_count"] == 2
    assert m["ferryman_inter_token_latency_seconds_count"] == 8  # 4 gaps per 5-token request
    assert m["ferryman_request_queue_seconds_count"] == 2
    assert m["ferryman_cached_prompt_tokens_total"] >= 0 and m["ferryman_engine_alive"] == 1
    assert m["ferryman_decode_link_reads"] == 0  # a CPU server: no CUDA graph, no link step
    for name in ("ferryman_num_requests_waiting", "ferryman_kv_cache_usage_ratio", "ferryman_expert_hits_total",
                 "ferryman_expert_misses_total", "ferryman_expert_bytes_fetched_total",
                 "ferryman_memory_bytes{kind=kv_cache}", "ferryman_memory_bytes{kind=weights}"):
        assert name in m, name
    assert m["ferryman_memory_bytes{kind=kv_cache}"] > 0
    stats = httpx.get(server.url + "/v1/stats").json()
    assert stats["alive"] and stats["generation_tokens_total"] == 10 and stats["requests_finished_total"] == 2
    assert stats["num_running"] == 0 and stats["memory_bytes"]["kv_cache"] > 0
    assert stats["slow_steps"] >= 0 and stats["slowest_step"]["sequences"] >= 1


def test_engine_killed_mid_stream(server: LiveServer) -> None:
    """Clients get an error within 2 s of the engine dying; /health turns 503; new requests fail at once."""
    delay_steps(server, 0.02)
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=30)
    failed_after: list[float] = []
    started = threading.Barrier(4)
    killed_at = [0.0]

    def stream() -> None:
        s = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}],
                                           max_tokens=400, stream=True)
        it = iter(s)
        next(it)
        started.wait(10)
        try:
            for _ in it:
                pass
        except openai.APIError as e:
            assert "engine is dead" in e.message
            failed_after.append(time.monotonic() - killed_at[0])

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait(10)
    killed_at[0] = time.monotonic()
    server.loop.inject_fault(RuntimeError("simulated GPU fault"))
    for t in threads:
        t.join(10)
    assert len(failed_after) == 3 and max(failed_after) < 2.0, failed_after
    wait_until(lambda: httpx.get(server.url + "/health").status_code == 503, timeout_s=2.0, what="health 503")
    assert "simulated GPU fault" in httpx.get(server.url + "/health").json()["reason"]
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "again"}], max_tokens=4)
    assert e.value.status_code == 503 and "engine is dead" in e.value.message and time.monotonic() - t0 < 1.0
    assert httpx.get(server.url + "/metrics").text.count("ferryman_engine_alive 0.0") == 1


def test_watchdog_catches_a_hung_step(server: LiveServer) -> None:
    server.loop.step_timeout_s = 0.3
    delay_steps(server, 2.0)  # one step "hangs" for 2 s
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=30)
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError, match="more than 0.3 s"):
        client.completions.create(model="tiny", prompt="hang", max_tokens=4)
    assert time.monotonic() - t0 < 2.0
    assert httpx.get(server.url + "/health").status_code == 503


def test_metrics_report_device_memory_peaks_when_the_engine_has_them() -> None:
    """On CUDA the engine's stats carry the allocator's peaks (`LLMEngine.memory_stats`); /metrics
    turns them into ferryman_memory_peak_bytes, and leaves the family out on CPU (no peaks)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from ferryman.server.metrics import EngineCollector

    def scrape(snapshot: dict) -> dict[str, float]:
        registry = CollectorRegistry()
        loop = SimpleNamespace(stats_snapshot=snapshot, num_pending=0, alive=True)
        registry.register(EngineCollector(loop, {"weights": 1}))
        return _samples(generate_latest(registry).decode())

    peaks = {"plan_total": 8 << 30, "plan_activations": 1 << 30, "peak_allocated": 7 << 30, "peak_reserved": 3 << 31}
    m = scrape({"memory_peaks": peaks})
    assert m["ferryman_memory_peak_bytes{kind=allocated}"] == 7 << 30
    assert m["ferryman_memory_peak_bytes{kind=reserved}"] == 3 << 31
    assert not any(k.startswith("ferryman_memory_peak_bytes") for k in scrape({}))
