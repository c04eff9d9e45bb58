"""Experts moved per prefill chunk through the expert cache, against the ideal (dev VM, CPU).

    python benchmarks/bench_prefill_stream.py

A chunk that routes to every expert must bring in each one that is not cached. The best a cache of
S slots can do across chunks is to keep S - W experts in place (W: the window the current layer
and the streamed-in next layer need) and stream the rest: ideal = total - (S - W). A cache that
flushes itself every chunk (LRU-like on a cyclic scan) moves all `total`.

Cases: a random-weight qwen3_moe config (8 layers x 64 experts, top-4: near-uniform routing, every
expert touched per chunk) and the bundled demo model (real, skewed routing: not every expert is
touched, so its ideal bound is loose). Prints experts moved per chunk after a first prompt filled
the cache, the ideal and the total.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ferryman import LLM, SamplingParams  # noqa: E402

UNIFORM = {
    "model_type": "qwen3_moe", "vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 8192,
    "num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 64, "intermediate_size": 256,
    "norm_topk_prob": True, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32",
    "rope_theta": 10000.0,
}


def moved_per_chunk(llm: LLM, prompt: list[int], chunk: int) -> float:
    s0 = llm.stats()["experts"]
    llm.generate(prompt_token_ids=[prompt], params=SamplingParams(max_tokens=1))
    s1 = llm.stats()["experts"]
    moved = (s1["misses"] - s0["misses"]) + (s1["prefetch_fetched"] - s0["prefetch_fetched"])
    return moved / (len(prompt) // chunk)


def run(name: str, model: str | None, cache: str, chunk: int, vocab: int, **kw: object) -> None:
    llm = LLM(model, device="cpu", moe_strategy="offload", expert_cache=cache, max_num_batched_tokens=chunk,
              enforce_eager=True, prefill_mode="chunk", **kw)
    cfg = llm.engine.cfg
    total, slots = len(cfg.moe_layers) * cfg.num_experts, llm.stats()["experts"]["slots"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, vocab, (2 * chunk,), generator=gen).tolist() for _ in range(3)]
    moved_per_chunk(llm, prompts[0], chunk)  # fills the cache
    moved = sum(moved_per_chunk(llm, p, chunk) for p in prompts[1:]) / 2
    ideal = total - max(0, slots - 2 * cfg.num_experts)
    print(f"| {name} | {cache} ({slots} slots) | {chunk} | {moved:.1f} | {ideal} | {total} | {moved / total:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args()
    print("| model | cache | chunk | moved per chunk | ideal | total | moved / total |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(UNIFORM))
        for cache in ("50%", "25%"):
            run("random-weight qwen3_moe 8x64", tmp, cache, 1024, 1000, load_format="dummy")
    for cache in ("50%", "25%"):
        run("demo model", None, cache, 256, 8000, dtype="float32")


if __name__ == "__main__":
    main()
