"""`ferryman plan`'s predictions beside a served load's measurement (the memory split's check).

    python benchmarks/bench_split.py RESULT.json [RESULT_8K.json] --model gpt-oss-20b --gpu-memory 8GiB \
        --max-num-seqs 32 --max-model-len 8192 [--stats STATS.json]

RESULT.json is `ferryman bench serve --json`'s (levels of concurrency, prompt / output tokens in its
config). The prediction (ferryman/plan_report.py `predict`) takes the link rate from the server's
/v1/stats (--stats: bytes copied / copy time) when given, else this machine's calibration, else
the assumed PCIe 5.0 rate. Prints one row per level: output tok/s and TTFT p50, measured and
predicted, their ratio, and the issue's targets (1 user >= 50 tok/s, 4 users >= 1.3 x 1 user,
32 users >= 180 tok/s) where a level matches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ferryman.cli import calibrated_link  # noqa: E402
from ferryman.config import EngineConfig  # noqa: E402
from ferryman.experts.placement import engine_plan  # noqa: E402
from ferryman.models.registry import model_config  # noqa: E402
from ferryman.plan_report import predict  # noqa: E402
from ferryman.weights.build import resolve_dtype, resolve_hf_config  # noqa: E402

TARGETS = {1: ("tok/s >= 50", lambda tps, one: tps >= 50), 4: ("tok/s >= 1.3 x 1 user", lambda tps, one: tps >= 1.3 * one),
           32: ("tok/s >= 180", lambda tps, one: tps >= 180)}


def link_from_stats(path: Path | None) -> tuple[float, str] | None:
    if path is None or not path.exists():
        return None
    experts = json.loads(path.read_text()).get("experts", {})
    if not experts.get("h2d_seconds"):
        return None
    return experts["bytes_h2d"] / experts["h2d_seconds"], "measured by the server"


def rows_of(result: dict, plan, link: tuple[float, str]) -> list[dict]:
    cfg = result["config"]
    prompt, output = cfg["prompt_tokens"], cfg["output_tokens"]
    out, one = [], None
    for level in result["levels"]:
        users = level["concurrency"]
        p = predict(plan, link[0], link[1], users, prompt, output)
        tps = level["output_tokens_per_s"]
        one = tps if users == 1 else one
        target = TARGETS.get(users) if prompt <= 1024 else None
        out.append({"users": users, "prompt": prompt, "tok_s": tps, "pred_tok_s": p.decode_tok_s,
                    "ttft_s": level.get("ttft_s_p50"), "pred_ttft_s": p.ttft_s, "pred_hit_rate": p.hit_rate,
                    "errors": level.get("errors"), "target": target[0] if target else "",
                    "met": (target[1](tps, one or 0.0) if target else None)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--model", default="gpt-oss-20b")
    ap.add_argument("--gpu-memory", default="8GiB")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--stats", type=Path, help="the server's /v1/stats JSON after the load (link rate)")
    a = ap.parse_args()
    ecfg = EngineConfig(model=a.model, load_format="dummy", gpu_memory=a.gpu_memory, max_num_seqs=a.max_num_seqs,
                        max_model_len=a.max_model_len)
    cfg = model_config(resolve_hf_config(ecfg.model, "dummy")[0])
    dtype = resolve_dtype(ecfg.dtype, cfg)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    plan = engine_plan(ecfg, cfg, dtype, device, ecfg.context_len(cfg))
    link = link_from_stats(a.stats) or calibrated_link(cfg, dtype)
    print(f"link {link[0] / 1e9:.1f} GB/s ({link[1]}); plan: {plan.expert_slots} slots of "
          f"{len(cfg.moe_layers) * cfg.num_experts}, KV {plan.kv_tokens} tokens at start")
    cols = ("users", "prompt", "tok_s", "pred_tok_s", "ttft_s", "pred_ttft_s", "pred_hit_rate", "errors", "target", "met")
    print("| " + " | ".join(cols) + " | tok/s ratio | TTFT ratio |")
    print("|" + " --- |" * (len(cols) + 2))
    for path in a.results:
        for r in rows_of(json.loads(path.read_text()), plan, link):
            f = lambda v: "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
            ratio = r["tok_s"] / r["pred_tok_s"] if r["pred_tok_s"] else None
            tratio = r["ttft_s"] / r["pred_ttft_s"] if r["ttft_s"] and r["pred_ttft_s"] else None
            print("| " + " | ".join(f(r[c]) for c in cols) + f" | {f(ratio)} | {f(tratio)} |")


if __name__ == "__main__":
    main()
