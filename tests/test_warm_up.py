"""The serve warm-up (engine/warm_up.py): every batch size from a full prefill step down to one
sequence, nothing left behind (requests, prefix cache, step counters), answers unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferryman import LLM, SamplingParams
from ferryman.engine.warm_up import warm_up
from tiny_models import build_tiny, greedy_ids


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])  # gpt_oss: the window pool too
def test_warm_up_runs_every_batch_size_and_leaves_nothing(arch: str, tmp_path: Path) -> None:
    build_tiny(arch, tmp_path)
    kw = dict(device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=6, max_num_batched_tokens=48)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = greedy_ids(LLM(str(tmp_path), **kw), prompts, 6)
    llm = LLM(str(tmp_path), **kw)
    report = warm_up(llm.engine)
    assert report.batch_sizes[0] == 6  # the first step: six 8-token prompts fill the 48-token chunk
    assert set(range(1, 7)) <= set(report.batch_sizes)  # they finish one by one, then one alone
    assert report.steps == len(report.batch_sizes) == len(report.shapes) and report.seconds > 0
    # prompts beside decodes: a chunk filled by decodes and a cut prompt, then a tail beside them
    mixed = [(d, p) for d, p in report.shapes if d and p]
    assert any(d + p == 48 for d, p in mixed), report.shapes
    assert any(d + p < 48 for d, p in mixed), report.shapes
    eng = llm.engine
    assert not eng.has_unfinished() and not eng.requests and not eng.finished
    assert not eng.scheduler.pool.cached and eng.stats()["steps"] == 0
    assert greedy_ids(llm, prompts, 6) == want
    eng.add_request([3, 4], SamplingParams(max_tokens=1))  # a request in flight: refused
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(eng)


def test_warm_up_leaves_the_guess_gates_to_real_traffic(tmp_path: Path) -> None:
    """Offloaded experts: the warm-up's guesses were graded (small batches, one sequence); after
    it every gate is open again and no grade is left."""
    build_tiny("qwen3_moe", tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=4,
              max_num_batched_tokens=32, moe_strategy="offload", expert_cache="25%")
    guesser = llm.engine.runner.experts.guesser
    before: list[int] = []
    reset = guesser.reset_grades

    def counted_reset() -> None:  # what the warm-up had graded, just before it forgets it
        before.append(sum(c.recall_total for c in guesser.every_grade()))
        reset()

    guesser.reset_grades = counted_reset
    warm_up(llm.engine)
    assert before and before[0] > 0  # the warm-up's decode steps graded guesses
    every = guesser.every_grade()
    assert every and all(c.enabled and c.fetched == 0 and c.recall_total == 0 for c in every)
    assert not guesser.pending and not guesser.gap_pending


def test_slow_steps_are_counted_with_their_shape_and_queueing_is_measured(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """What a first-run TTFT outlier needs to be explained: each request's time before its first
    step, and every step over SLOW_STEP_S with its sequences and tokens."""
    from ferryman.engine import llm_engine

    build_tiny("qwen3_moe", tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=2,
              max_num_batched_tokens=16)
    monkeypatch.setattr(llm_engine, "SLOW_STEP_S", 0.0)  # every step is "slow"
    outs = llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9], [10, 11, 12]],
                        params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    st = llm.stats()
    assert st["slow_steps"] == st["steps"] > 0
    slow = st["slowest_step"]
    assert slow["seconds"] > 0 and 1 <= slow["sequences"] <= 2 and slow["tokens"] >= slow["prefill_tokens"]
    for o in outs:
        m = o.metrics
        assert m.queue_s is not None and 0 <= m.queue_s <= m.ttft_s
    assert outs[2].metrics.queue_s > outs[0].metrics.queue_s  # the third waited for a place (2 at a time)
