"""Time an agent-sized prompt through `LLM.generate` on the demo model (default context 32768).

    python -m tools.demo_model.long_prompt --tokens 12000 --device cpu --dtype float32

The prompt is held-out standard-library source (the model card's held-out files found in this
Python), cut to --tokens. It runs twice: the second run finds the prompt in the prefix cache, as
an agent's next turn does.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from ferryman import LLM, SamplingParams
from tools.demo_model.context_eval import heldout_stream


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=12000, help="prompt tokens (default: 12000)")
    p.add_argument("--output", type=int, default=32, help="tokens generated (default: 32)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (default: cpu)")
    p.add_argument("--dtype", default="auto", help="auto (bf16), float32, ... (default: auto)")
    a = p.parse_args()
    t = time.perf_counter()
    llm = LLM(device=a.device, dtype=a.dtype)
    print(f"loaded in {time.perf_counter() - t:.1f} s; max_model_len {llm.engine.max_model_len}", flush=True)
    stream = heldout_stream(Path(llm.config.model))
    prompt = stream[: a.tokens]
    params = SamplingParams(temperature=0.0, max_tokens=a.output, ignore_eos=True)
    for run in ("uncached", "cached prefix"):
        t = time.perf_counter()
        out = llm.generate(prompt_token_ids=[prompt], params=params)[0]
        m = out.metrics
        print(f"{run}: {len(prompt)} prompt tokens, {len(out.token_ids)} out, {time.perf_counter() - t:.1f} s in all, "
              f"time to first token {m.ttft_s:.2f} s, decode {m.decode_tokens_per_s or 0:.1f} tok/s", flush=True)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
