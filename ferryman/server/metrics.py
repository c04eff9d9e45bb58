"""Prometheus metrics (one registry per server) and the JSON of /v1/stats.

Latencies are observed in the engine thread as tokens are handed out (`EngineLoop` observer):
TTFT from the request's arrival at the server, inter-token latency between two deliveries of
one request. Engine state (queue depth, KV usage, expert cache counters, memory split) is read
at scrape time from the snapshot the engine thread takes after each step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ferryman.engine.outputs import RequestOutput
from ferryman.server.engine_loop import EngineLoop, RequestHandle

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)
# metric -> (key in engine stats()["experts"] (the expert cache, when offloading), help); absent = 0
_EXPERT_COUNTERS = {"expert_hits": ("hits", "expert cache hits (expert uses served from device slots)"),
                    "expert_misses": ("misses", "expert cache misses (experts fetched from host RAM)"),
                    "expert_bytes_fetched": ("bytes_h2d", "expert bytes copied host -> device")}
# finished requests' counts: ferryman_<name> in /metrics, <name>_total in /v1/stats -> (RequestMetrics field, help)
_TOKEN_COUNTERS = {"prompt_tokens": ("num_prompt_tokens", "prompt tokens of finished requests"),
                   "cached_prompt_tokens": ("num_cached_tokens", "prompt tokens served by the prefix cache"),
                   "generation_tokens": ("num_output_tokens", "output tokens generated")}


class EngineCollector(Collector):
    def __init__(self, loop: EngineLoop, memory: dict[str, int]) -> None:
        self.loop, self.memory = loop, memory

    def collect(self) -> Iterator[Any]:
        s = self.loop.stats_snapshot
        gauges = {
            "ferryman_num_requests_running": ("sequences running in the engine", s.get("num_running", 0)),
            "ferryman_num_requests_waiting": ("sequences waiting for admission (queue depth)", s.get("num_waiting", 0)),
            "ferryman_requests_in_flight": ("requests accepted by the server, not yet answered", self.loop.num_pending),
            "ferryman_kv_cache_usage_ratio": ("fraction of KV blocks held by sequences", s.get("kv_usage", 0.0)),
            "ferryman_prefix_cache_hit_rate": ("prompt tokens served by the prefix cache / looked up",
                                               s.get("prefix_hit_rate", 0.0)),
            "ferryman_engine_alive": ("1 while the engine loop runs", 1.0 if self.loop.alive else 0.0),
            "ferryman_decode_link_reads": ("1 while decode steps read uncached experts over the link (0: copies "
                                           "or nothing to miss)", 1.0 if s.get("cuda_graph_mode") == "link" else 0.0),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        mem = GaugeMetricFamily("ferryman_memory_bytes", "memory by use (experts_host: host RAM)", labels=["kind"])
        for kind, value in self.memory.items():
            mem.add_metric([kind], float(value))
        yield mem
        peaks = s.get("memory_peaks") if isinstance(s.get("memory_peaks"), dict) else {}
        if peaks:  # CUDA: what the caching allocator peaked at (reserved is what the budget caps)
            peak = GaugeMetricFamily("ferryman_memory_peak_bytes", "device memory peak since start", labels=["kind"])
            for kind in ("allocated", "reserved"):
                peak.add_metric([kind], float(peaks[f"peak_{kind}"]))
            yield peak
        yield CounterMetricFamily("ferryman_preemptions", "sequences preempted", value=float(s.get("num_preemptions", 0)))
        experts = s.get("experts") if isinstance(s.get("experts"), dict) else {}
        for name, (key, doc) in _EXPERT_COUNTERS.items():
            yield CounterMetricFamily(f"ferryman_{name}", doc, value=float(experts.get(key, 0)))
        yield from _split_metrics(s.get("memory_split") if isinstance(s.get("memory_split"), dict) else {})


def _split_metrics(split: dict[str, Any]) -> Iterator[Any]:
    """The region KV blocks and expert slots share (engine/memory_split.py): pages by owner, KV blocks
    by state, moves by direction. Nothing without a shared region (resident experts)."""
    if not split:
        return
    pages = GaugeMetricFamily("ferryman_memory_split_pages", "pages of the shared device region, by owner",
                              labels=["owner"])
    pages.add_metric(["kv"], float(split["kv_pages"]))
    pages.add_metric(["experts"], float(split["expert_pages"]))
    yield pages
    blocks = GaugeMetricFamily("ferryman_kv_blocks", "KV blocks of the shared region's KV pages", labels=["state"])
    blocks.add_metric(["used"], float(split["kv_blocks_used"]))
    blocks.add_metric(["free"], float(split["kv_blocks_free"]))
    yield blocks
    moves = CounterMetricFamily("ferryman_memory_moves", "pages moved between the KV and expert caches",
                                labels=["to"])
    moves.add_metric(["kv"], float(split["moves_to_kv"]))
    moves.add_metric(["experts"], float(split["moves_to_experts"]))
    yield moves


class ServerMetrics:
    """Counters and histograms; also the `EngineLoop` observer."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.memory: dict[str, int] = {}
        self.requests = Counter("ferryman_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.tokens = {name: Counter(f"ferryman_{name}", doc, registry=r) for name, (_, doc) in _TOKEN_COUNTERS.items()}
        self.finished = Counter("ferryman_request_finished", "engine requests finished, by reason",
                                ["reason"], registry=r)
        self.ttft = self._latency("time_to_first_token_seconds", "arrival -> first output token")
        self.queue = self._latency("request_queue_seconds", "arrival -> first scheduled in a step")
        self.itl = self._latency("inter_token_latency_seconds", "time between two output tokens of a request")
        self.e2e = self._latency("e2e_request_latency_seconds", "arrival -> last output token")
        self._totals = dict.fromkeys([*(f"{name}_total" for name in _TOKEN_COUNTERS), "requests_finished_total"], 0)

    def _latency(self, name: str, doc: str) -> Histogram:
        return Histogram(f"ferryman_{name}", doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

    def attach(self, loop: EngineLoop) -> None:
        loop.observer = self
        self.memory = loop.engine.memory_usage()
        self.registry.register(EngineCollector(loop, self.memory))

    # ---- EngineLoop observer (engine thread) ----------------------------------------------------
    def on_token(self, handle: RequestHandle, now: float, first: bool) -> None:
        if first:
            self.ttft.observe(now - handle.arrival)
        elif handle.last_token_time is not None:
            self.itl.observe(now - handle.last_token_time)

    def on_finish(self, handle: RequestHandle, output: RequestOutput) -> None:
        m = output.metrics
        for name, (attr, _) in _TOKEN_COUNTERS.items():
            self.tokens[name].inc(getattr(m, attr))
            self._totals[f"{name}_total"] += getattr(m, attr)
        self.finished.labels(output.finish_reason or "unknown").inc()
        self._totals["requests_finished_total"] += 1
        if handle.last_token_time is not None:
            self.e2e.observe(handle.last_token_time - handle.arrival)
        if m.queue_s is not None:
            self.queue.observe(m.queue_s)

    # ---- HTTP ----------------------------------------------------------------------------------
    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def totals(self) -> dict[str, int]:
        return dict(self._totals)
