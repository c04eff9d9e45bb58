"""Resident decode speed on CUDA: every weight on the GPU, batch 1 (or --batch), greedy.

    python benchmarks/bench_decode.py --model gpt-oss-20b --load-format dummy --tokens 256

Prints decode tokens/s, the bytes one decode step must read (non-expert weights except the
embedding table + top-k experts per layer), the device's copy bandwidth measured in the same run,
and the ratio of achieved to that memory-bandwidth limit.
"""

from __future__ import annotations

import argparse
import time

import torch

from ferryman import LLM, SamplingParams
from ferryman.models.summary import summarize
from ferryman.weights.build import resolve_hf_config


def device_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reps = 20
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * reps / (time.perf_counter() - t0)


def bytes_per_token(model: str, load_format: str) -> int:
    hf, _ = resolve_hf_config(model, load_format)
    s = summarize(hf)
    c = s.cfg
    embed = c.vocab_size * c.hidden_size * c.dtype.itemsize  # gathered, not read whole
    return s.other_bytes - embed + len(c.moe_layers) * c.top_k * s.bytes_per_expert


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-oss-20b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, profile N decode tokens: top kernels by GPU time and GPU busy / wall")
    a = ap.parse_args()
    bw = device_bandwidth()
    t0 = time.perf_counter()
    llm = LLM(a.model, device="cuda", load_format=a.load_format, max_model_len=4096,
              max_num_seqs=max(a.batch, 1), enforce_eager=a.enforce_eager)
    load_s = time.perf_counter() - t0
    vocab = llm.engine.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (a.prompt_tokens,), generator=g).tolist() for _ in range(a.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    logits = llm.score([prompts[0][:64]])[0]
    if not torch.isfinite(logits).all():
        raise SystemExit("non-finite logits: the weights or kernels are broken, timing would be meaningless")
    llm.generate(prompt_token_ids=prompts, params=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, params=params)
    wall = time.perf_counter() - t0
    per_seq = [o.metrics.decode_tokens_per_s for o in outs]
    rate = sum(per_seq) / len(per_seq)
    need = bytes_per_token(a.model, a.load_format)
    limit = bw / need
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuda graphs {llm.stats()['cuda_graphs']}")
    print(f"model: {a.model} ({a.load_format}), resident, batch {a.batch}, prompt {a.prompt_tokens}, {a.tokens} greedy tokens")
    print(f"load time: {load_s:.1f} s; peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    print(f"decode: {rate:.1f} tok/s per sequence, {rate * a.batch:.1f} tok/s in all (wall {wall:.2f} s)")
    print(f"ttft: {outs[0].metrics.ttft_s * 1000:.1f} ms")
    print(f"bytes read per decode step: {need / 2**30:.3f} GiB; device copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"memory-bandwidth limit: {limit:.0f} tok/s; achieved / limit = {rate / limit:.2f}")
    if a.profile:
        try:
            profile(llm, prompts, a.profile)
        except Exception as e:  # noqa: BLE001 - the figures above stand without the profile
            print(f"profile failed: {e!r}")


def profile(llm: LLM, prompts: list[list[int]], tokens: int) -> None:
    """Where a decode step's time goes: kernels by total GPU time, and the GPU's idle share."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, params=params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    print(f"profile of {tokens} tokens: wall {wall * 1e3:.1f} ms, GPU busy {busy * 1e3:.1f} ms "
          f"({busy / wall:.0%}); per token {wall / tokens * 1e6:.0f} us wall, {busy / tokens * 1e6:.0f} us GPU")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:20]:
        print(f"  {e.self_device_time_total / tokens:9.1f} us/token  x{e.count / tokens:6.1f}  {e.key[:110]}")


if __name__ == "__main__":
    main()
