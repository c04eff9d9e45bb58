"""One model from its Hugging Face folder and from a GGUF file converted from it: bench_offload.py on
each, one process per run, alternated (folder, GGUF, folder, GGUF, ...: the GPU machine's decode
speed differs between processes, 38-40 or 52-60 tok/s for gpt-oss-20b at 8 GiB, so each source
meets both), then a table and the GGUF / folder ratios of decode tok/s and TTFT.

    python benchmarks/bench_gguf_vs_folder.py --folder /tmp/gptoss20b --gguf /tmp/gptoss20b-mxfp4.gguf \\
        --budget 8GiB --runs 2 --json out.json -- --moe-strategy offload --decode-tokens 128 --prefill-prompt 0

Arguments after `--` go to every bench_offload.py run. Ratios: per pair (run i of each source), and
best against best (the highest decode, the lowest TTFT of each source: the runs of the fast mode
when each source got one); "within" says whether that best-against-best ratio is inside --tolerance.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench_offload.py"
KEYS = ("decode_tok_s", "ttft_s", "decode_hit_rate", "h2d_mib_per_token", "slots", "experts", "load_s")


def run_once(target: str, extra: list[str], timeout: float) -> dict:
    """One bench_offload.py process on `target`; its row, or {"error": ...}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        try:
            proc = subprocess.run([sys.executable, str(BENCH), "--target", target, "--json", str(out), *extra],
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        sys.stderr.write(proc.stderr[-2000:])
        if proc.returncode != 0 or not out.exists():
            last = (proc.stderr.strip().splitlines() or [""])[-1]
            return {"error": f"exit {proc.returncode}: {last}"}
        rows = json.loads(out.read_text())
        return rows[0] if isinstance(rows, list) else rows


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(v: object) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def summary(runs: list[tuple[str, int, dict]], tolerance: float) -> dict:
    """Ratios GGUF / folder: per pair and best against best."""
    by = {src: [r for s, _, r in runs if s == src and "error" not in r] for src in ("folder", "gguf")}
    pairs = []
    for i in sorted({i for _, i, _ in runs}):
        f = next((r for s, j, r in runs if s == "folder" and j == i), {})
        g = next((r for s, j, r in runs if s == "gguf" and j == i), {})
        pairs.append({"run": i, "decode": ratio(g.get("decode_tok_s"), f.get("decode_tok_s")),
                      "ttft": ratio(g.get("ttft_s"), f.get("ttft_s"))})
    best = {}
    if by["folder"] and by["gguf"]:
        best_decode = [max((r.get("decode_tok_s") or 0.0) for r in by[s]) for s in ("folder", "gguf")]
        best_ttft = [min((r.get("ttft_s") or float("inf")) for r in by[s]) for s in ("folder", "gguf")]
        best = {"decode": ratio(best_decode[1], best_decode[0]), "ttft": ratio(best_ttft[1], best_ttft[0])}
    # decode may be faster, TTFT shorter; only the slower side counts against the tolerance
    within = bool(best) and all(v is not None for v in best.values()) \
        and best["decode"] >= 1 - tolerance and best["ttft"] <= 1 + tolerance
    return {"pairs": pairs, "best": best, "within": within, "tolerance": tolerance}


def save(path: Path | None, runs: list[tuple[str, int, dict]], tolerance: float) -> None:
    if path is not None:
        rows = [{"source": src, "run": i, **r} for src, i, r in runs]
        path.write_text(json.dumps({"runs": rows, **summary(runs, tolerance)}, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", required=True, help="the Hugging Face model folder")
    ap.add_argument("--gguf", required=True, help="the GGUF file converted from it")
    ap.add_argument("--budget", default="8GiB", help="GPU memory of every run (bench_offload's MODEL:BUDGET)")
    ap.add_argument("--runs", type=int, default=2, help="runs of each source, alternated")
    ap.add_argument("--run-timeout", type=float, default=150.0, help="seconds one bench_offload run may take")
    ap.add_argument("--tolerance", type=float, default=0.05, help="the allowed GGUF / folder shortfall")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="-- then bench_offload.py arguments")
    a = ap.parse_args()
    extra = [x for x in a.extra if x != "--"]
    runs: list[tuple[str, int, dict]] = []
    for i in range(1, a.runs + 1):
        for source, model in (("folder", a.folder), ("gguf", a.gguf)):
            row = run_once(f"{model}:{a.budget}", extra, a.run_timeout)
            runs.append((source, i, row))
            print(f"run {i} {source}: " + ", ".join(f"{k} {fmt(row.get(k))}" for k in KEYS + ("error",) if k in row),
                  flush=True)
            save(a.json, runs, a.tolerance)  # after each run: a suite cut short keeps what ran
    print("\n| run | source | " + " | ".join(KEYS) + " |")
    print("|" + " --- |" * (len(KEYS) + 2))
    for source, i, row in runs:
        print(f"| {i} | {source} | " + " | ".join(fmt(row.get(k)) for k in KEYS) + " |")
    s = summary(runs, a.tolerance)
    print("\nGGUF / folder:")
    for p in s["pairs"]:
        print(f"  run {p['run']}: decode {fmt(p['decode'])}, TTFT {fmt(p['ttft'])}")
    print(f"  best against best: decode {fmt(s['best'].get('decode'))}, TTFT {fmt(s['best'].get('ttft'))}; "
          f"within {a.tolerance:.0%}: {'yes' if s['within'] else 'no'}")


if __name__ == "__main__":
    main()
