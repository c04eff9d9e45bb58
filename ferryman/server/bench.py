"""`ferryman bench serve URL`: a load generator for any OpenAI-compatible /v1/completions endpoint.

For each concurrency level, `concurrency` workers send streamed requests back to back until the
level's request count is done. Prompts are token-id arrays of exactly `prompt_tokens` random ids
(distinct per request, so no prefix cache hit), outputs `output_tokens` long (`ignore_eos`, as
vLLM's benchmark does). Per request: TTFT (send -> first token), the gaps between streamed chunks
(inter-token latency) and TPOT ((end - first token) / (tokens - 1)); per level: p50 / p99 of each
and output tokens/s over the level's wall time. Only the standard library is needed (plot: matplotlib).
"""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ferryman.errors import ConfigError

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32)


@dataclass
class BenchConfig:
    url: str  # server root, e.g. http://127.0.0.1:8000
    model: str | None = None  # None: the first of /v1/models
    levels: tuple[int, ...] = DEFAULT_LEVELS
    prompt_tokens: int = 128
    output_tokens: int = 64
    requests_per_level: int | None = None  # None: max(8, 2 x concurrency); 0: one per user
    api_key: str | None = None
    timeout_s: float = 300.0
    seed: int = 0
    token_id_range: tuple[int, int] = (100, 5000)  # ids drawn for synthetic prompts


@dataclass
class RequestResult:
    ttft_s: float = 0.0
    tpot_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


def _headers(cfg: BenchConfig) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if cfg.api_key:
        h["Authorization"] = f"Bearer {cfg.api_key}"
    return h


def _get_json(cfg: BenchConfig, path: str) -> Any:
    req = urllib.request.Request(cfg.url.rstrip("/") + path, headers=_headers(cfg))
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


def first_model(cfg: BenchConfig) -> str:
    return _get_json(cfg, "/v1/models")["data"][0]["id"]


STATS_LAG_S = 0.3  # above the server's refresh period of /v1/stats (engine_loop.py: 0.2 s)


def link_bytes(cfg: BenchConfig) -> int | None:
    """Expert bytes the server moved host -> device so far (ferryman's /v1/stats); None elsewhere."""
    try:
        moved = _get_json(cfg, "/v1/stats")["experts"]["bytes_h2d"]
    except (OSError, ValueError, LookupError, TypeError):  # a peer without /v1/stats or expert counters
        return None
    return int(moved) if isinstance(moved, (int, float)) else None


def _sse_data(resp: Any) -> Any:
    """Yield (arrival time, parsed JSON) of each `data:` line until [DONE]."""
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield time.perf_counter(), json.loads(data)


def run_request(cfg: BenchConfig, model: str, prompt: list[int]) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": cfg.output_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    req = urllib.request.Request(cfg.url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                 headers=_headers(cfg))
    res, arrivals = RequestResult(), []
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=cfg.timeout_s) as resp:
            for now, obj in _sse_data(resp):
                if "error" in obj:
                    raise RuntimeError(obj["error"].get("message", "error"))
                if obj.get("usage"):
                    res.output_tokens = obj["usage"]["completion_tokens"]
                if obj.get("choices") and obj["choices"][0].get("text"):
                    arrivals.append(now)
    except urllib.error.HTTPError as e:  # the server's error object says why
        res.error = f"HTTP {e.code}: {_error_message(e)}"
        return res
    except (OSError, RuntimeError, ValueError) as e:  # URLError is an OSError
        res.error = f"{type(e).__name__}: {e}"
        return res
    if not arrivals:
        res.error = "no tokens streamed"
        return res
    res.ttft_s = arrivals[0] - start
    res.chunk_gaps_s = [b - a for a, b in zip(arrivals, arrivals[1:])]
    res.output_tokens = res.output_tokens or len(arrivals)
    if res.output_tokens > 1:
        res.tpot_s = (arrivals[-1] - arrivals[0]) / (res.output_tokens - 1)
    return res


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read() or b"{}")
        return str(body.get("error", body).get("message", e.reason))
    except (OSError, ValueError, AttributeError):  # not a JSON object, or an error that is none
        return str(e.reason)


def percentile(values: list[float], q: int) -> float | None:
    """Percentile q in 1..99, interpolated as numpy's default does; None when empty."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def run_level(cfg: BenchConfig, model: str, concurrency: int, rng: random.Random) -> dict[str, Any]:
    n = max(8, 2 * concurrency) if cfg.requests_per_level is None else (cfg.requests_per_level or concurrency)
    lo, hi = cfg.token_id_range
    prompts = [[rng.randrange(lo, hi) for _ in range(cfg.prompt_tokens)] for _ in range(n)]
    before = link_bytes(cfg)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as users:  # each user sends its next request when one ends
        results = list(users.map(lambda prompt: run_request(cfg, model, prompt), prompts))
    wall = time.perf_counter() - start
    row = summarize(concurrency, results, wall)
    if before is not None:
        time.sleep(STATS_LAG_S)  # ferryman's /v1/stats may lag the last step of the level
    after = link_bytes(cfg)
    moved = after - before if before is not None and after is not None else None
    row["link_bytes"] = moved  # expert bytes copied during the level (prefill included)
    row["link_bytes_per_output_token"] = moved / row["output_tokens"] if moved is not None and row["output_tokens"] else None
    return row


def summarize(concurrency: int, results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s for r in ok]
    gaps = [g for r in ok for g in r.chunk_gaps_s]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    tokens = sum(r.output_tokens for r in ok)
    row: dict[str, Any] = {"concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
                           "wall_s": wall_s, "output_tokens": tokens,
                           "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
                           "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0}
    for name, values in (("ttft_s", ttft), ("itl_s", gaps), ("tpot_s", tpot)):
        row[f"{name}_p50"] = percentile(values, 50)
        row[f"{name}_p99"] = percentile(values, 99)
        row[f"{name}_mean"] = statistics.fmean(values) if values else None
    row["first_error"] = next((r.error for r in results if r.error), None)
    return row


def run_bench(cfg: BenchConfig, log: Any = None) -> dict[str, Any]:
    model = cfg.model or first_model(cfg)
    rng = random.Random(cfg.seed)
    run_request(cfg, model, [rng.randrange(*cfg.token_id_range) for _ in range(cfg.prompt_tokens)])  # warm-up
    levels = []
    for c in cfg.levels:
        row = run_level(cfg, model, c, rng)
        levels.append(row)
        if log is not None:
            log(format_row(row))
    return {"config": {**asdict(cfg), "api_key": None, "model": model}, "levels": levels}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def format_row(r: dict[str, Any]) -> str:
    return (f"c={r['concurrency']:>3}  req={r['requests']:>3} err={r['errors']}  "
            f"TTFT p50/p99 {_ms(r['ttft_s_p50'])}/{_ms(r['ttft_s_p99'])} ms  "
            f"ITL p50/p99 {_ms(r['itl_s_p50'])}/{_ms(r['itl_s_p99'])} ms  "
            f"out {r['output_tokens_per_s']:.1f} tok/s  TTFT mean {_ms(r['ttft_s_mean'])} ms"
            + (f"  link {r['link_bytes_per_output_token'] / 2**20:.1f} MiB/token"
               if r.get("link_bytes_per_output_token") is not None else ""))


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["levels"]
    c = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in ((axes[0], "ttft_s", "TTFT (ms)"), (axes[1], "itl_s", "inter-token latency (ms)")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(c, [(r[f"{key}_{q}"] or 0) * 1000 for r in rows], style, label=q)
        ax.set_title(title)
        ax.legend()
    axes[2].plot(c, [r["output_tokens_per_s"] for r in rows], "o-")
    axes[2].set_title("output tokens/s")
    cfg = result["config"]
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{cfg['model']} @ {cfg['url']}: prompt {cfg['prompt_tokens']}, output {cfg['output_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
