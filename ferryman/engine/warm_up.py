"""Warm-up before serving: run the step shapes the first users would otherwise compile.

Triton compiles a kernel at its first launch for each specialisation of its integer arguments
(1, a multiple of 16, anything else: sequences and tokens of a step), and autotunes some. So
`ferryman serve` first runs waves of requests (`waves_for`) whose steps cover every batch size
up to min(max_num_seqs, 16), prompts beside decodes, and each specialisation; then the engine
forgets them (`LLMEngine.reset_after_warm_up`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ferryman.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ferryman.engine.llm_engine import LLMEngine

MAX_BATCH = 16  # a multiple of 16 reaches Triton's third specialisation


@dataclass(frozen=True)
class WarmUpReport:
    seconds: float
    steps: int
    batch_sizes: tuple[int, ...]  # sequences of each step, in order
    slowest_s: float = 0.0  # the slowest step (a first compile, typically)
    shapes: tuple[tuple[int, int], ...] = ()  # (decoding sequences, prompt tokens) of each step


@dataclass(frozen=True)
class Wave:
    """Prompt lengths added at once, and `joins` added after the wave's first step (its prompts
    are decoding by then)."""

    prompts: list[int]
    joins: list[int] = field(default_factory=list)


def warm_up(engine: LLMEngine) -> WarmUpReport:
    """Run the warm-up requests to completion on an idle engine (RuntimeError otherwise)."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up() needs an idle engine")
    start, sizes, shapes = time.perf_counter(), [], []
    engine.warming_up = True
    try:
        slowest = _run_waves(engine, sizes, shapes)
    finally:
        engine.warming_up = False
    engine.reset_after_warm_up()
    return WarmUpReport(time.perf_counter() - start, len(sizes), tuple(sizes), slowest, tuple(shapes))


def waves_for(batch: int, chunk: int, max_model_len: int) -> list[Wave]:
    """The warm-up's waves for `batch` sequences at most, `chunk` tokens per step."""
    length = max(2, min(max_model_len - 8, chunk // batch))
    cap = max(2, max_model_len - 8)
    half = max(1, batch // 2)
    long = min(cap, max(2, chunk // 3 + 1))  # three of them overflow what the decodes leave of a chunk
    return [Wave([length] * batch),  # a full chunk; then every batch size as they finish
            Wave([length] * half, [long] * min(3, batch - half) + [min(cap, 37)]),  # prompts beside decodes
            Wave([min(cap, max(2, chunk // 4))] * 3),  # a few sequences, a round number of tokens
            Wave([min(cap, 33)] * min(5, batch)),  # odd counts of both
            Wave([max(2, length - 1)])]  # one alone


def _run_waves(engine: LLMEngine, sizes: list[int], shapes: list[tuple[int, int]]) -> float:
    """The warm-up's requests, wave by wave, to completion; appends each step's sequence count to
    `sizes` and its (decodes, prompt tokens) to `shapes`; returns the slowest step's seconds."""
    batch = max(1, min(engine.ecfg.max_num_seqs, MAX_BATCH))
    chunk = engine.ecfg.max_num_batched_tokens  # the engine's planner resolved it
    assert chunk is not None  # LLMEngine replaces ecfg with the plan's step size
    vocab = engine.cfg.vocab_size
    made = 0

    def add(lengths: list[int]) -> list[int]:
        nonlocal made
        rids = [engine.add_request(_prompt(made + i, n, vocab),
                                   SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True))
                for i, n in enumerate(lengths)]
        made += len(lengths)
        return rids

    for wave in waves_for(batch, chunk, engine.max_model_len):
        rids, steps = add(wave.prompts), 0
        while engine.has_unfinished():
            if steps == 1:
                rids += add(wave.joins)
            engine.step()
            steps += 1
            sizes.append(engine.last_step_size)
            shapes.append(engine.last_step_shape)
        for rid in rids:
            engine.pop_output(rid)
    return float(engine.slowest_step.get("seconds", 0.0))


def _prompt(i: int, n: int, vocab: int) -> list[int]:
    """Token ids spread over the vocabulary, distinct per request (no prefix is shared)."""
    lo = min(100, vocab - 1)
    return [lo + (7919 * (i + 1) + 104729 * j) % (vocab - lo) for j in range(n)]
