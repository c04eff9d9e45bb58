"""CPU decode speed: ferryman vs transformers' `generate` on the same tiny weights, in one run.

    python benchmarks/bench_cpu_vs_transformers.py [--arch qwen3_moe] [--tokens 128]
    python benchmarks/bench_cpu_vs_transformers.py --model demo --dtype bfloat16 --tokens 256

Prints both decode rates (tokens/s after the first token, batch 1, greedy) and their ratio.
`--model demo` uses the bundled demo model in its shipped dtype; default: a tiny random model.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import ARCHS, build_tiny  # noqa: E402

from transformers import AutoModelForCausalLM  # noqa: E402

from ferryman import LLM, SamplingParams  # noqa: E402
from ferryman.llm import DEMO_MODEL  # noqa: E402


def hf_decode_rate(model: torch.nn.Module, ids: list[int], n: int) -> float:
    x = torch.tensor([ids])
    mask = torch.ones_like(x)
    with torch.no_grad():
        model.generate(x, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        model.generate(x, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        total = time.perf_counter() - t0
    return (n - 1) / (total - first)


def ferryman_decode_rate(folder: Path, ids: list[int], n: int, dtype: str) -> float:
    llm = LLM(str(folder), device="cpu", dtype=dtype, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.generate(prompt_token_ids=[ids], params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    out = llm.generate(prompt_token_ids=[ids], params=params)[0]
    return out.metrics.decode_tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3_moe", choices=ARCHS)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model", default=None, help="'demo' for the bundled demo model (default: tiny random)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    if a.model == "demo":
        folder, name = DEMO_MODEL, "bundled demo model"
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True).eval()
    else:
        folder, name = Path(tempfile.mkdtemp()) / a.arch, f"tiny {a.arch} (tests/tiny_models.py)"
        ref = build_tiny(a.arch, folder).to(dtype)
    ids = list(range(3, 35))
    hf = hf_decode_rate(ref, ids, a.tokens)
    ours = ferryman_decode_rate(folder, ids, a.tokens, a.dtype)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"model: {name}, {a.dtype}, batch 1, {a.tokens} greedy tokens")
    print(f"transformers generate: {hf:.1f} tok/s")
    print(f"ferryman:              {ours:.1f} tok/s")
    print(f"ratio ferryman / transformers: {ours / hf:.2f}")


if __name__ == "__main__":
    main()
