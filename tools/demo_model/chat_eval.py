"""How often the model ends its turn: greedy answers to held-out chat prompts, short ones and ones
that open with a long agent-like system message, generated through ferryman.

The prompts are built from the held-out split exactly as the training conversations are
(chat_mix.py, another seed), cut before their last assistant message. Generation runs through
ferryman's `LLM` on the build's device; if ferryman cannot run there, transformers' `generate`
measures instead and the record says so ("engine").
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ferryman import LLM, SamplingParams
from tools.demo_model.chat_mix import MixSpec, mixed_samples
from tools.demo_model.evaluate import load_exported
from tools.demo_model.train import Log

EVAL_GPU_MEMORY = "24GiB"  # ferryman's device budget while measuring; its KV floor: EVAL_SEQS x 32768 x 5 KiB
EVAL_SEQS = 64  # sequences decoded together on a GPU
HF_BATCH_TOKENS = 65_536  # prompt tokens per transformers generate batch (the fallback)


def eval_prompts(tokenizer: Tokenizer, texts: list[str], names: list[str], mix: MixSpec, seed: int, end_id: int,
                 count: int) -> dict[str, list[list[int]]]:
    """Up to `count` held-out prompts of each kind, each ending with `<|im_start|>assistant\\n`."""
    short, long = mixed_samples(tokenizer, texts, names, mix, seed, end_id, short=2 * count, long=2 * count)
    return {"short": [s.ids[:s.prompt_len] for s in short][:count],
            "long_system": [s.ids[:s.prompt_len] for s in long][:count]}


def summarise(ended: list[bool], lengths: list[int], prompts: list[list[int]], max_tokens: int) -> dict:
    done = [n for n, e in zip(lengths, ended) if e]
    return {"prompts": len(prompts), "ended": len(done), "share": len(done) / max(len(prompts), 1),
            "max_tokens": max_tokens, "mean_tokens_when_ended": sum(done) / max(len(done), 1),
            "prompt_tokens": [min(map(len, prompts), default=0), max(map(len, prompts), default=0)]}


def ferryman_turns(folder: Path, prompts: list[list[int]], max_tokens: int, device: torch.device,
                   stop_ids: list[int]) -> dict:
    """Greedy generation through ferryman: an answer ends when it stops on one of stop_ids
    (`<|endoftext|>`, `<|im_end|>`: finish_reason "stop") within max_tokens."""
    return summarise(*ferryman_ends(folder, prompts, max_tokens, device, stop_ids), prompts, max_tokens)


def ferryman_ends(folder: Path, prompts: list[list[int]], max_tokens: int, device: torch.device,
                  stop_ids: list[int]) -> tuple[list[bool], list[int]]:
    """(ended, answer length) of each prompt, one engine for all of them."""
    cap = {"gpu_memory": EVAL_GPU_MEMORY, "max_num_seqs": EVAL_SEQS} if device.type == "cuda" else {}
    llm = LLM(str(folder), device=device.type, dtype="float32", **cap)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_ids)
    outs = llm.generate(prompt_token_ids=prompts, params=params)
    del llm  # frees its device memory before the next engine starts
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [o.finish_reason == "stop" for o in outs], [len(o.token_ids) for o in outs]


def hf_turns(folder: Path, prompts: list[list[int]], max_tokens: int, device: torch.device, stop_ids: list[int],
             pad_id: int) -> dict:
    """The same measure with transformers' greedy `generate`."""
    return summarise(*hf_ends(folder, prompts, max_tokens, device, stop_ids, pad_id), prompts, max_tokens)


@torch.no_grad()
def hf_ends(folder: Path, prompts: list[list[int]], max_tokens: int, device: torch.device, stop_ids: list[int],
            pad_id: int) -> tuple[list[bool], list[int]]:
    """(ended, answer length) of each prompt: left-padded batches of similar length."""
    model = load_exported(folder, device)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    ended, lengths = [False] * len(prompts), [0] * len(prompts)
    start = 0
    while start < len(order):
        rows = max(1, HF_BATCH_TOKENS // (len(prompts[order[start]]) + max_tokens))
        group = order[start:start + rows]
        start += len(group)
        width = max(len(prompts[i]) for i in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.int64)  # [B, W], left-padded
        mask = torch.zeros((len(group), width), dtype=torch.int64)
        for r, i in enumerate(group):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=stop_ids, pad_token_id=pad_id)[:, width:].cpu()
        for r, i in enumerate(group):
            hits = [k for k, t in enumerate(out[r].tolist()) if t in stop_ids]
            ended[i], lengths[i] = bool(hits), (hits[0] + 1 if hits else max_tokens)  # the stop token counts
    return ended, lengths


def turn_end_rates(folder: Path, prompts: dict[str, list[list[int]]], max_tokens: int, device: torch.device,
                   stop_ids: list[int], log: Log) -> dict:
    """{kind: figures} for each prompt kind, and "engine": what generated the answers."""
    flat = [p for kind in prompts.values() for p in kind]
    try:
        ended, lengths = ferryman_ends(folder, flat, max_tokens, device, stop_ids)
        engine = f"ferryman ({device.type})"
    except Exception as e:  # the fine-tune's result must not be lost to an engine failure on a new device
        log(f"ferryman could not generate on {device}: {type(e).__name__}: {e}; measuring with transformers")
        ended, lengths = hf_ends(folder, flat, max_tokens, device, stop_ids, stop_ids[0])
        engine = f"transformers ({device.type})"
    out, start = {}, 0
    for kind, p in prompts.items():
        out[kind] = summarise(ended[start:start + len(p)], lengths[start:start + len(p)], p, max_tokens)
        start += len(p)
    return {**out, "engine": engine}
