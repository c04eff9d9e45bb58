"""Long prompts through a running `ferryman serve`: time to first token per prompt length, and the
stall a decoding user sees while a long prompt is prefilled (layer-major prefill, issue 25).

    python3 benchmarks/bench_long_prompt.py http://127.0.0.1:8150 --lengths 4170,16384,32000 \
        --stall-prompt 32000 --json out.json

TTFT: `--runs` streamed requests per length, fresh random token ids each (no prefix-cache hit),
2 output tokens; the first run of the longest length also pays first-use costs, so each length
reports every run and the best. Stall: one user decodes `--stall-output` tokens; once it streams,
a `--stall-prompt`-token prompt arrives; the user's longest gap between two tokens, against its
median gap, is what the prefill costs it. The server's /v1/stats `prefill_jobs` (steps that ran
job layers beside decodes, and the longest of them) are read after. Expert bytes moved per
prompt come from /v1/stats too (`link_bytes`). Each length also records the host's speed before its
runs (`probe_us`, benchmarks/host_usage.py: a fixed Python workload on the client, the same machine as
the server), since the layer-major prefill is partly bound by the host's work.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from dataclasses import replace

import urllib.request

from host_usage import probe_us
from ferryman.server.bench import STATS_LAG_S, BenchConfig, RequestResult, first_model, link_bytes, run_request


def server_stats(cfg: BenchConfig) -> dict:
    with urllib.request.urlopen(cfg.url.rstrip("/") + "/v1/stats", timeout=30) as resp:
        return json.load(resp)


def prompt_of(cfg: BenchConfig, n: int, rng: random.Random) -> list[int]:
    lo, hi = cfg.token_id_range
    return [rng.randrange(lo, hi) for _ in range(n)]


def ttft(cfg: BenchConfig, model: str, length: int, runs: int, rng: random.Random) -> dict:
    times, moved, probe = [], [], probe_us()
    for _ in range(runs):
        before = link_bytes(cfg)
        res = run_request(replace(cfg, output_tokens=2), model, prompt_of(cfg, length, rng))
        if res.error:
            return {"prompt_tokens": length, "error": res.error}
        times.append(round(res.ttft_s, 4))
        time.sleep(STATS_LAG_S)
        after = link_bytes(cfg)
        if before is not None and after is not None:
            moved.append(round((after - before) / 2**30, 3))
    return {"prompt_tokens": length, "ttft_s": min(times), "ttft_runs_s": times, "link_gib_runs": moved,
            "probe_us": probe}


def stall(cfg: BenchConfig, model: str, prompt: int, output: int, rng: random.Random) -> dict:
    """A decoding user's longest token gap while `prompt` tokens are prefilled beside it."""
    user: list[RequestResult] = []
    thread = threading.Thread(target=lambda: user.append(
        run_request(replace(cfg, output_tokens=output), model, prompt_of(cfg, 64, rng))))
    thread.start()
    time.sleep(1.0)  # the user streams by now
    long = run_request(replace(cfg, output_tokens=1), model, prompt_of(cfg, prompt, rng))
    thread.join()
    res = user[0]
    if res.error or long.error:
        return {"error": res.error or long.error}
    gaps = res.chunk_gaps_s
    return {"prompt_tokens": prompt, "long_ttft_s": round(long.ttft_s, 4), "user_max_gap_s": round(max(gaps), 4),
            "user_median_gap_s": round(statistics.median(gaps), 4), "user_tokens": res.output_tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument("--lengths", default="4170,16384,32000", help="prompt lengths for TTFT, comma-separated")
    p.add_argument("--runs", type=int, default=2, help="requests per length")
    p.add_argument("--stall-prompt", type=int, default=32000, help="the long prompt beside a decoding user (0: skip)")
    p.add_argument("--stall-output", type=int, default=400, help="tokens the decoding user asks for")
    p.add_argument("--json", help="write the results here too")
    a = p.parse_args()
    cfg = BenchConfig(url=a.url, timeout_s=600.0)
    model, rng = first_model(cfg), random.Random(0)
    out: dict = {"levels": [ttft(cfg, model, n, a.runs, rng) for n in map(int, a.lengths.split(","))]}
    if a.stall_prompt:
        out["stall"] = stall(cfg, model, a.stall_prompt, a.stall_output, rng)
    time.sleep(STATS_LAG_S)
    stats = server_stats(cfg)
    out["prefill_mode"], out["prefill_jobs"] = stats.get("prefill_mode"), stats.get("prefill_jobs")
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
