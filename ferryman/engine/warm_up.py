"""Warm-up before serving: run the step shapes the first users would otherwise compile.

Triton compiles a kernel at its first launch for each specialisation of its integer arguments
(1, a multiple of 16, anything else: sequences and tokens of a step), and autotunes some. A server
that skipped this made its first requests pay for it: on the H200 a 16-user run on a fresh machine
had a mean time to first token of 1.16-1.37 s, and the same run right after 0.66-0.69 s
(docs/benchmarks.md, session 14). So `ferryman serve` first runs a prefill chunk of
min(max_num_seqs, 16) sequences that fills a step, their decodes as they finish one by one (every
batch size down to 1), then smaller waves whose sequence and token counts fall in the other
specialisations, and one sequence alone; then it forgets the prompts (prefix cache), the step
counters and the guesses' grades (on the H200 the warm-up's small batches had turned the batch
guesses of 4 layers off for the whole run: hit rate 0.86 against 0.94).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
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


def warm_up(engine: LLMEngine) -> WarmUpReport:
    """Run the warm-up requests to completion on an idle engine (RuntimeError otherwise)."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up() needs an idle engine")
    start, sizes = time.perf_counter(), []
    engine.warming_up = True
    try:
        slowest = _run_waves(engine, sizes)
    finally:
        engine.warming_up = False
    guesser = getattr(engine.runner.experts, "guesser", None)
    if guesser is not None:  # the gates learn from real traffic, not from these small batches
        guesser.reset_grades()
    engine.scheduler.pool.reset_prefix_cache()
    if engine.scheduler.window_pool is not None:
        engine.scheduler.window_pool.reset_prefix_cache()
    engine.num_steps = engine.num_generated = engine.slow_steps = 0
    engine.slowest_step = {}
    return WarmUpReport(time.perf_counter() - start, len(sizes), tuple(sizes), slowest)


def _run_waves(engine: LLMEngine, sizes: list[int]) -> float:
    """The warm-up's requests, wave by wave, to completion; appends each step's sequence count to
    `sizes`; returns the slowest step's seconds."""
    batch = max(1, min(engine.ecfg.max_num_seqs, MAX_BATCH))
    chunk = engine.ecfg.max_num_batched_tokens  # the engine's planner resolved it
    assert chunk is not None  # LLMEngine replaces ecfg with the plan's step size
    length = max(2, min(engine.max_model_len - 8, chunk // batch))
    vocab = engine.cfg.vocab_size
    cap = max(2, engine.max_model_len - 8)
    waves = ([length] * batch,  # a full chunk; then every batch size as they finish
             [min(cap, max(2, chunk // 4))] * 3,  # a few sequences, a round number of tokens
             [min(cap, 33)] * min(5, batch),  # odd counts of both
             [max(2, length - 1)])  # one alone
    for wave in waves:
        rids = [engine.add_request(_prompt(i, n, vocab), SamplingParams(temperature=0.0, max_tokens=2 + i,
                                                                          ignore_eos=True))
                for i, n in enumerate(wave)]
        while engine.has_unfinished():
            engine.step()
            sizes.append(engine.last_step_size)
        for rid in rids:
            engine.pop_output(rid)
    return float(engine.slowest_step.get("seconds", 0.0))


def _prompt(i: int, n: int, vocab: int) -> list[int]:
    """Token ids spread over the vocabulary, distinct per request (no prefix is shared)."""
    lo = min(100, vocab - 1)
    return [lo + (7919 * (i + 1) + 104729 * j) % (vocab - lo) for j in range(n)]
