"""How widely a model's dummy weights route in decode, per expert format: random weights stand in for
real ones in the offload benchmarks, and their hit rates mean something only if the decode spreads
over the experts as uniform routing would.

    python benchmarks/bench_dummy_routing.py [--model qwen3-30b-a3b] [--quantization none,int4,fp8]
        [--layers 2] [--tokens 64]
    python benchmarks/bench_dummy_routing.py --model FILE.gguf     # a random file, e.g. tools/gguf_random's

A preset keeps its first --layers layers (random weights, CPU, every expert resident); a random
64-token prompt, then --tokens greedy tokens. Per format and MoE layer: the distinct experts the
decode steps chose and the share of choices taken by the top 10% of experts (uniform routing: about
0.1 plus noise; one token repeated: 1.0).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fewer_layers import fewer_layers  # noqa: E402

from ferryman import LLM, SamplingParams  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tools/: after the ferryman already imported
from tools.demo_model.trace import RoutingTrace, attach_trace, top_share  # noqa: E402


def spread(model: str, quantization: str, layers: int, tokens: int) -> list[tuple[int, int, int, float]]:
    """(layer, decode steps, distinct experts, top-10% share) per MoE layer."""
    kw = dict(device="cpu", max_model_len=64 + tokens + 8, progress=False, moe_strategy="resident")
    if Path(model).exists():  # a file of random weights as it is (tools/gguf_random.py's, its own formats)
        llm = LLM(model, **kw)
    else:
        llm = LLM(fewer_layers(model, layers), load_format="dummy", quantization=quantization, **kw)
    trace = RoutingTrace()
    attach_trace(llm.engine.runner.model, trace)
    cfg = llm.engine.cfg
    prompt = torch.randint(1, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate(None, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), prompt_token_ids=[prompt])
    rows = []
    for layer in trace.layers:
        decode = torch.cat([p for p in trace.ids[layer] if p.shape[0] == 1])  # [steps, K]: the decode steps
        distinct = int(decode.unique().numel())
        rows.append((layer, decode.shape[0], distinct, top_share(decode, cfg.num_experts)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b",
                    help="preset, or a model file / folder of random weights (default: %(default)s)")
    ap.add_argument("--quantization", default="none,int4,fp8",
                    help="dummy expert formats, comma-separated (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=2, help="layers kept (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens decoded (default: %(default)s)")
    a = ap.parse_args()
    print("| model | experts | layer | decode steps | distinct experts | top 10% share |")
    print("| --- | --- | --- | --- | --- | --- |")
    formats = ["its own"] if Path(a.model).exists() else a.quantization.split(",")  # a file: once
    for q in formats:
        for layer, steps, distinct, share in spread(a.model, q, a.layers, a.tokens):
            print(f"| {a.model} | {q} | {layer} | {steps} | {distinct} | {share:.2f} |", flush=True)


if __name__ == "__main__":
    main()
