"""Batched decode with offloaded experts: N sequences decoding together, the way `ferryman serve`
runs them at N users, without the HTTP layer, the arrivals and the prefills in between (which make
served figures spread by 10% or more between identical runs).

    python benchmarks/bench_batch_decode.py --target gpt-oss-20b:8GiB --seqs 16 --modes off,early --reps 2

The engine is planned as the serve benchmark plans it (--seqs sequences of --max-model-len), so it
gets the same expert slots. Per run: --seqs prompts of --prompt tokens are prefilled (not timed),
then all decode --tokens tokens together; the figures cover the decode steps only:
- out tok/s: tokens produced / time, all sequences together;
- link MiB / token and the link limit: the measured link bandwidth / bytes copied per token;
- link busy: seconds the copy stream spent copying / decode time (1.0 = the link never idled).
With --closed-loop R, each of the --seqs users instead sends R requests back to back (the next as
its last one finishes), as `ferryman bench serve` does, prefills mixed into the decode steps: tok/s
over the whole run and the mean time to first token, with no HTTP or tokenizer threads beside the
engine (set beside a served run, this separates the engine from the server around it).
Modes switch inside one engine, in turn (off, early, off, early, ...), so the A/B shares the
machine's state: `off` and `early` set the decode prefetch (OffloadConfig.decode_prefetch: the
next layer's router on this layer's MoE input, with the engine's guess widths); `cpu` and
`early+cpu` also turn on the hybrid split (the engine is then started with --moe-strategy hybrid;
`off`/`early` switch it off); --strategy starts the engine with another moe_strategy (layers, cpu,
auto: then only `off`/`early` apply); `+noadm` turns the cache policy's admission control off (lrfu
admit_margin None, experts/policies.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bench_offload import link_bandwidth  # noqa: E402

from ferryman import LLM, SamplingParams  # noqa: E402

MODES = ("off", "early", "cpu", "early+cpu")  # each may add +noadm
MODE = re.compile(r"^(off|cpu|early)((?:\+(?:cpu|noadm))*)$")
COUNTERS = ("hits", "misses", "bytes_h2d", "h2d_seconds", "stall_seconds", "prefetch_fetched", "prefetch_hits",
            "cpu_computed")


@dataclasses.dataclass(frozen=True)
class Defaults:
    """The engine's own settings that modes override, read once before the first mode."""

    margin: float | None  # the cache policy's admission margin (lrfu)
    split_by_mode: bool = True  # modes turn the hybrid split on (+cpu) and off; False: --strategy decides

    @staticmethod
    def of(llm: LLM) -> "Defaults":
        experts = llm.engine.runner.experts
        if getattr(experts, "guesser", None) is None:
            raise SystemExit("this engine has no next-layer guesser (not offloaded, or prefetch off)")
        return Defaults(getattr(experts.cache.table.policy, "admit_margin", None))


def set_mode(llm: LLM, mode: str, defaults: Defaults) -> None:
    """Decode prefetch and the hybrid split as `mode` says, on the running engine."""
    experts = llm.engine.runner.experts
    guesser = experts.guesser
    assert MODE.match(mode) is not None  # main() checked every mode
    guesser.decode = mode.startswith("early")
    for c in guesser.every_grade():  # each run grades its own guesses
        c.enabled = c.gap_enabled = True
    policy = experts.cache.table.policy
    if hasattr(policy, "admit_margin"):  # lrfu
        policy.admit_margin = None if "+noadm" in mode else defaults.margin
    hybrid = getattr(experts, "hybrid", None)
    if "cpu" in mode and hybrid is None:
        raise SystemExit(f"mode {mode!r} needs the engine started with the hybrid split (--modes lists a cpu mode)")
    if hybrid is not None and defaults.split_by_mode:  # --strategy: the engine's own choice stands
        hybrid.decision = dataclasses.replace(hybrid.decision, enabled="cpu" in mode)


def run(llm: LLM, prompts: list[list[int]], tokens: int, bw: float) -> dict:
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    rids = [eng.add_request(p, params) for p in prompts]
    produced = lambda: sum(eng.requests[r].seq.num_output_tokens for r in rids if r in eng.requests)  # noqa: E731
    while any(r in eng.requests and not eng.requests[r].seq.num_output_tokens for r in rids):  # the prefills
        eng.step()
    before, first = eng.stats()["experts"], produced()
    start, steps = time.perf_counter(), 0
    while any(r in eng.requests for r in rids):
        eng.step()
        steps += 1
    spent = time.perf_counter() - start
    after = eng.stats()["experts"]
    for r in rids:
        eng.pop_output(r)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    return _rates(d, len(prompts) * tokens - first, spent, steps, bw, eng.plan.slot_bytes)


def _rates(d: dict, out: int, spent: float, steps: int, bw: float, slot_bytes: int) -> dict:
    """A run's figures from its counter deltas `d`: `out` tokens in `spent` seconds over `steps`.
    The link limit divides the bandwidth by the bytes copied per token; the needed-bytes limit by
    those less the copies of guessed experts that were never used (wrong guesses)."""
    per_token = d["bytes_h2d"] / out
    wasted = max(0, d["prefetch_fetched"] - d["prefetch_hits"]) * slot_bytes / out
    needed = per_token - wasted
    return {"out_tok_s": out / spent, "steps": steps, "step_ms": spent / steps * 1e3,
            "link_mib_per_token": per_token / 2**20, "link_limit_tok_s": bw / per_token if per_token else None,
            "wasted_mib_per_token": wasted / 2**20, "needed_limit_tok_s": bw / needed if needed > 0 else None,
            "link_busy": d["h2d_seconds"] / spent, "stall_s": d["stall_seconds"],
            "hit_rate": d["hits"] / max(1, d["hits"] + d["misses"]),
            "prefetch_precision": d["prefetch_hits"] / d["prefetch_fetched"] if d["prefetch_fetched"] else None,
            "cpu_experts_per_step": d["cpu_computed"] / steps}


def run_closed_loop(llm: LLM, users: int, rounds: int, prompt_of: Callable[[], list[int]], tokens: int,
                    bw: float) -> dict:
    """Each of `users` sends `rounds` requests back to back (the next as soon as the last finished),
    as `ferryman bench serve` loads a server, but in this process: no HTTP, no tokenizer threads.
    Output tok/s over the whole run (prefills included) and mean TTFT (arrival -> first token)."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    left = [rounds] * users
    live: dict[int, tuple[int, float]] = {}  # request id -> (user, arrival)
    ttft: dict[int, float] = {}

    def send(user: int) -> None:
        left[user] -= 1
        live[eng.add_request(prompt_of(), params)] = (user, time.perf_counter())

    before = eng.stats()["experts"]
    start, steps = time.perf_counter(), 0
    for user in range(users):
        send(user)
    while live:
        eng.step()
        steps += 1
        now = time.perf_counter()
        for rid, (user, arrival) in list(live.items()):
            req = eng.requests.get(rid)
            if rid not in ttft and (req is None or req.seq.num_output_tokens):
                ttft[rid] = now - arrival
            if req is None:  # finished this step
                eng.pop_output(rid)
                del live[rid]
                if left[user]:
                    send(user)
    spent = time.perf_counter() - start
    d = {k: eng.stats()["experts"].get(k, 0) - before.get(k, 0) for k in COUNTERS}
    return {**_rates(d, users * rounds * tokens, spent, steps, bw, eng.plan.slot_bytes),
            "ttft_mean_s": sum(ttft.values()) / len(ttft), "ttft_max_s": max(ttft.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="gpt-oss-20b:8GiB", help="MODEL:BUDGET, dummy weights")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=1536)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per sequence")
    ap.add_argument("--modes", default="off,early", help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--reps", type=int, default=2, help="rounds over the modes")
    ap.add_argument("--closed-loop", type=int, default=0, metavar="ROUNDS",
                    help="each of --seqs users sends ROUNDS requests back to back, as `ferryman bench serve` "
                         "does (prefills mixed in; tok/s over the whole run and mean TTFT); 0: decode only")
    ap.add_argument("--strategy", default=None,
                    help="the engine's moe_strategy (default: hybrid when --modes lists a cpu mode, else offload)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if bad := [m for m in modes if not MODE.match(m)]:
        raise SystemExit(f"unknown mode(s) {bad}: choose from {', '.join(MODES)} (each may add +noadm)")
    model, budget = a.target.split(":")
    hybrid = any("cpu" in m for m in modes)
    # demo:cpu is a smoke test on the CPU: the demo model with a 10% cache
    kw = (dict(device="cpu", expert_cache="10%") if budget == "cpu" else dict(gpu_memory=budget))
    if model != "demo":
        kw["load_format"] = "dummy"
    llm = LLM(None if model == "demo" else model, max_num_seqs=a.seqs, max_model_len=a.max_model_len,
              moe_strategy=a.strategy or ("hybrid" if hybrid else "offload"), progress=False, **kw)

    eng = llm.engine
    bw = link_bandwidth(eng.plan.slot_bytes, eng.device)
    gen = torch.Generator().manual_seed(0)
    rand = lambda: torch.randint(1, eng.cfg.vocab_size, (a.prompt,), generator=gen).tolist()  # noqa: E731
    defaults = dataclasses.replace(Defaults.of(llm), split_by_mode=a.strategy is None)
    set_mode(llm, modes[0], defaults)
    run(llm, [rand() for _ in range(a.seqs)], 8, bw)  # warm-up: compiles, graph captures
    print(f"{model} at {budget}: {eng.stats()['experts'].get('slots')} slots, {a.seqs} sequences x {a.tokens} tokens "
          f"after {a.prompt}-token prompts; link {bw / 1e9:.1f} GB/s; {platform.node()}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
    rows = []
    for rep in range(a.reps):
        for mode in modes:
            set_mode(llm, mode, defaults)
            if a.closed_loop:
                got = run_closed_loop(llm, a.seqs, a.closed_loop, rand, a.tokens, bw)
            else:
                got = run(llm, [rand() for _ in range(a.seqs)], a.tokens, bw)
            row = {"mode": mode, "rep": rep, **got}
            rows.append(row)
            ttft = f", TTFT mean {row['ttft_mean_s']:.3f} s (max {row['ttft_max_s']:.3f})" if a.closed_loop else ""
            print(f"{mode:10s} rep {rep}: {row['out_tok_s']:6.1f} tok/s{ttft}, step {row['step_ms']:6.1f} ms, "
                  f"{row['link_mib_per_token']:6.1f} MiB/token, link busy {row['link_busy']:.2f}, "
                  f"{row['out_tok_s'] / row['link_limit_tok_s']:.2f} of the link limit "
                  f"({row['out_tok_s'] / (row['needed_limit_tok_s'] or float('inf')):.2f} over needed bytes), "
                  f"hit rate {row['hit_rate']:.2f}, "
                  f"prefetch precision {row['prefetch_precision'] or 0:.2f}, CPU experts/step {row['cpu_experts_per_step']:.1f}",
                  flush=True)
    for mode in modes:
        mine = [r["out_tok_s"] for r in rows if r["mode"] == mode]
        print(f"{mode:10s} mean {sum(mine) / len(mine):6.1f} tok/s over {len(mine)} runs "
              f"({', '.join(f'{v:.1f}' for v in mine)})")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
