"""Time to first token of an agent's second turn (prefix cached) vs the same prompt cold.

    python benchmarks/bench_prefix_cache.py [--model FOLDER|PRESET] [--load-format dummy] [--device cpu]
                                            [--prefix-tokens 1536] [--tail-tokens 64]
                                            [--gpu-memory 16GiB] [--layers N]

Turn 1 sends a long prefix; turn 2 resends it plus a new tail (as agents do). The same turn-2
prompt is then timed on a fresh engine (cold). Prints both TTFTs, the cached token count and the
speed-up, all measured in this run.

Both engines first run `ferryman serve`'s warm-up and one unmeasured conversation of the same
shapes with other tokens, so neither side's figure includes Triton compiling a shape (on the
H200 a 64-token warm-up alone left a 128-token tail over a 4096-token cache to compile inside
the measured turn: 230 ms against 397 ms cold; docs/benchmarks.md, prefix cache).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

from ferryman import LLM, SamplingParams
from ferryman.engine.warm_up import warm_up

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fewer_layers import fewer_layers  # noqa: E402


def ttft(llm: LLM, ids: list[int]) -> tuple[float, int]:
    out = llm.generate(prompt_token_ids=[ids], params=SamplingParams(temperature=0.0, max_tokens=1))[0]
    return out.metrics.ttft_s, out.metrics.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or preset (default: the demo model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prefix-tokens", type=int, default=1536)
    ap.add_argument("--tail-tokens", type=int, default=64)
    ap.add_argument("--gpu-memory", default=None, help="VRAM budget, e.g. 16GiB (default: the plan's)")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers of MODEL")
    ap.add_argument("--quantization", default="none",
                    help="expert format of dummy weights, e.g. int4 or fp8 (default: %(default)s, the model's own)")
    a = ap.parse_args()
    kw = dict(device=a.device, load_format=a.load_format, max_model_len=a.prefix_tokens + a.tail_tokens + 16,
              max_num_seqs=1, gpu_memory=a.gpu_memory, quantization=a.quantization)
    source = fewer_layers(a.model, a.layers) if a.layers else a.model
    warm_llm = LLM(source, **kw)
    g = torch.Generator().manual_seed(0)
    vocab = warm_llm.engine.cfg.vocab_size

    def rand(n: int) -> list[int]:  # random ids: two draws share no KV block
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    unmeasured = (rand(a.prefix_tokens), rand(a.tail_tokens))  # the shapes compile here
    prefix, tail = rand(a.prefix_tokens), rand(a.tail_tokens)
    warm_up(warm_llm.engine)
    ttft(warm_llm, unmeasured[0])
    ttft(warm_llm, unmeasured[0] + unmeasured[1])
    first, _ = ttft(warm_llm, prefix)
    warm, cached = ttft(warm_llm, prefix + tail)
    del warm_llm
    cold_llm = LLM(source, **kw)
    warm_up(cold_llm.engine)
    ttft(cold_llm, unmeasured[0] + unmeasured[1])
    cold, cold_cached = ttft(cold_llm, prefix + tail)
    print(f"machine: {platform.machine()}, device {cold_llm.engine.device}, torch {torch.__version__}")
    layers = f", first {a.layers} layers" if a.layers else ""
    print(f"model: {a.model or 'bundled demo model'}{layers}, VRAM budget {a.gpu_memory or 'the plan'}; prefix {a.prefix_tokens} + tail {a.tail_tokens} tokens")
    print(f"turn 1 (prefix not cached): {first * 1e3:.1f} ms")
    print(f"turn 2, prefix cached ({cached} tokens from the cache): {warm * 1e3:.1f} ms")
    print(f"turn 2 on a fresh engine ({cold_cached} cached): {cold * 1e3:.1f} ms")
    print(f"speed-up of the cached turn: {cold / warm:.1f}x")


if __name__ == "__main__":
    main()
