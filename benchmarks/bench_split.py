"""`ferryman plan`'s predictions beside a served load's measurement (the memory split's check).

    python benchmarks/bench_split.py RESULT.json [RESULT_8K.json] --model gpt-oss-20b --gpu-memory 8GiB \
        --max-num-seqs 32 --max-model-len 8192 [--stats STATS.json] [--calibration CAL.json] [--json OUT.json]

RESULT.json is `ferryman bench serve --json`'s (levels of concurrency; prompt / output tokens and
requests per level in its config). The prediction (ferryman/plan_report.py `predict`) replays that
load through the engine's scheduling; its link rate comes from the server's /v1/stats (--stats:
bytes copied / copy time) when given, else the calibration, else the assumed PCIe 5.0 rate; its
compute rates from the calibration (`ferryman bench bw`, --calibration or the default file), else
measured here on CUDA by the same code (calibrate/device.py), else assumed. Prints one row per
level: output tok/s and TTFT p50, measured and predicted, their ratio, whether both are within 20%,
and the issue's targets for gpt-oss-20b at 8 GiB (1 user >= 50 tok/s, 4 users >= 1.3 x 1 user,
32 users >= 180 tok/s) where a level matches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ferryman.calibrate.device import measure_device_compute  # noqa: E402
from ferryman.cli_bench import calibrated_rates  # noqa: E402
from ferryman.config import EngineConfig  # noqa: E402
from ferryman.engine.model_runner import expert_activation  # noqa: E402
from ferryman.experts.placement import engine_plan  # noqa: E402
from ferryman.models.registry import model_config  # noqa: E402
from ferryman.plan_report import Load, predict  # noqa: E402
from ferryman.weights.build import resolve_dtype, resolve_hf_config  # noqa: E402

TARGETS = {1: ("tok/s >= 50", lambda tps, one: tps >= 50),
           4: ("tok/s >= 1.3 x 1 user", lambda tps, one: tps >= 1.3 * one),
           32: ("tok/s >= 180", lambda tps, one: tps >= 180)}


def link_from_stats(path: Path | None) -> tuple[float, str] | None:
    if path is None or not path.exists():
        return None
    experts = json.loads(path.read_text()).get("experts", {})
    if not experts.get("h2d_seconds"):
        return None
    return experts["bytes_h2d"] / experts["h2d_seconds"], "measured by the server"


def rows_of(result: dict, plan, rates, targets: bool) -> list[dict]:
    cfg = result["config"]
    prompt, output = cfg["prompt_tokens"], cfg["output_tokens"]
    out, one = [], None
    for level in result["levels"]:
        users = level["concurrency"]
        p = predict(plan, rates, Load(users, prompt, output, cfg.get("requests_per_level")))
        tps, ttft = level["output_tokens_per_s"], level.get("ttft_s_p50")
        one = tps if users == 1 else one
        target = TARGETS.get(users) if targets and prompt <= 1024 else None
        tok_ratio = tps / p.output_tok_s if p.output_tok_s else None
        ttft_ratio = ttft / p.ttft_s if ttft and p.ttft_s else None
        out.append({"users": users, "prompt": prompt, "tok_s": tps, "pred_tok_s": p.output_tok_s,
                    "pred_decode_tok_s": p.decode_tok_s, "ttft_s": ttft, "pred_ttft_s": p.ttft_s,
                    "pred_hit_rate": p.hit_rate, "pred_slots": p.slots, "errors": level.get("errors"),
                    "tok_ratio": tok_ratio, "ttft_ratio": ttft_ratio,
                    "within_20": None if tok_ratio is None or ttft_ratio is None else
                    all(abs(1 / r - 1) <= 0.2 for r in (tok_ratio, ttft_ratio)),
                    "target": target[0] if target else "", "met": (target[1](tps, one or 0.0) if target else None)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--model", default="gpt-oss-20b")
    ap.add_argument("--gpu-memory", default="8GiB")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--stats", type=Path, help="the server's /v1/stats JSON after the load (link rate)")
    ap.add_argument("--calibration", help="`ferryman bench bw`'s rates file (default: the one it writes for the model)")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    a = ap.parse_args()
    ecfg = EngineConfig(model=a.model, load_format="dummy", gpu_memory=a.gpu_memory, max_num_seqs=a.max_num_seqs,
                        max_model_len=a.max_model_len)
    cfg = model_config(resolve_hf_config(ecfg.model, "dummy")[0])
    dtype = resolve_dtype(ecfg.dtype, cfg)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    plan = engine_plan(ecfg, cfg, dtype, device, ecfg.context_len(cfg))
    rates = calibrated_rates(cfg, dtype, a.calibration, link_from_stats(a.stats))
    if rates.moe_seconds is None and device.type == "cuda":  # no calibration with device figures: measure them
        dc = measure_device_compute(cfg, dtype, expert_activation(cfg), device, reps=5)
        rates = dataclasses.replace(rates, moe_seconds=dc.moe_seconds, matmul_flops=dc.matmul_flops,
                                    compute_source="measured now (calibrate/device.py, as `ferryman bench bw` does)")
        print("device: MoE layer " + ", ".join(f"{t} tokens {s * 1e3:.2f} ms" for t, s in dc.moe)
              + f"; GEMM {dc.matmul_flops / 1e12:.0f} TFLOP/s")
    print(f"link {rates.link_bps / 1e9:.1f} GB/s ({rates.link_source}); compute {rates.compute_source}; plan: "
          f"{plan.expert_slots} slots of {len(cfg.moe_layers) * cfg.num_experts}, KV {plan.kv_tokens} tokens at start")
    cols = ("users", "prompt", "tok_s", "pred_tok_s", "tok_ratio", "ttft_s", "pred_ttft_s", "ttft_ratio", "within_20",
            "pred_hit_rate", "pred_slots", "errors", "target", "met")
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    rows = [r for path in a.results for r in rows_of(json.loads(path.read_text()), plan, rates,
                                                     a.model == "gpt-oss-20b" and a.gpu_memory == "8GiB")]
    f = lambda v: "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    for r in rows:
        print("| " + " | ".join(f(r[c]) for c in cols) + " |")
    judged = [r for r in rows if r["within_20"] is not None]
    print(f"predictions within 20% of the measurement (output tok/s and TTFT p50): "
          f"{sum(r['within_20'] for r in judged)} of {len(judged)} levels")
    if a.json:
        a.json.write_text(json.dumps({"link_gbps": rates.link_bps / 1e9, "link_source": rates.link_source,
                                      "compute_source": rates.compute_source, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
