"""The sliding-window layers' own KV pool (kvcache/window_pool.py): out-of-window blocks go back,
every step still finds its blocks, prefix hits adopt the window, and the tokens stay those of
transformers and of one pool for every layer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ferryman import LLM, SamplingParams
from ferryman.errors import ConfigError
from ferryman.engine.scheduler import Scheduler, SchedulerConfig
from ferryman.engine.sequence import Sequence
from ferryman.kvcache.block_pool import cdiv
from ferryman.kvcache.window_pool import NULL_BLOCK, WindowBlockPool, window_pool_blocks, window_pool_need, window_split
from tiny_models import build_tiny, hf_greedy, preset_config


def _seq(n: int, base: int = 0) -> Sequence:
    return Sequence([base + i % 50 + 1 for i in range(n)], SamplingParams(max_tokens=4, ignore_eos=True))


def test_release_hands_back_what_no_query_can_see() -> None:
    pool = WindowBlockPool(num_blocks=16, block_size=4, window=6)
    seq = _seq(30)
    assert pool.allocate_for(seq, 20) and len(seq.window_table) == 5 and len(pool.free_queue) == 10
    seq.num_computed_tokens = 20  # next query at 20 sees 15..20: blocks 3 and 4 (first_needed = 15 // 4)
    pool.release_stale(seq)
    assert seq.window_table[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in seq.window_table[3:]
    assert len(pool.free_queue) == 13
    pool.release_stale(seq)  # idempotent
    assert len(pool.free_queue) == 13
    pool.free(seq)
    assert len(pool.free_queue) == 15 and NULL_BLOCK not in pool.free_queue  # the null block is never free


def test_window_split_needs_both_kinds_of_layer() -> None:
    assert window_split(preset_config("gpt-oss-20b")) == 128
    assert window_split(preset_config("qwen3-30b-a3b")) is None  # no sliding layers


def test_a_pool_of_the_planned_size_never_runs_short() -> None:
    """Random prompts, chunks and finishes at full concurrency: every allocation succeeds without
    preempting (the main pool is ample), and between steps a sequence holds at most cdiv(W, S) + 1
    window blocks."""
    W, S, seqs, chunk = 10, 4, 6, 24
    cfg = SchedulerConfig(max_model_len=200, num_blocks=2000, max_num_seqs=seqs, max_num_batched_tokens=chunk,
                          block_size=S, window=W, num_window_blocks=window_pool_need(W, S, seqs, chunk))
    sched, rng = Scheduler(cfg), random.Random(0)
    for i in range(40):
        sched.add(Sequence([rng.randrange(1, 90) for _ in range(rng.randrange(1, 60))],
                           SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True)))
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.preempted, "the window pool ran short"
        sched.update(out, {s.seq.seq_id: 7 for s in out.scheduled if s.sample})
        for seq in sched.running:
            held = [b for b in seq.window_table if b != NULL_BLOCK]
            assert len(held) <= cdiv(W, S) + 1
        steps += 1
    assert steps > 40 and len(sched.window_pool.free_queue) == cfg.num_window_blocks - 1


def test_a_prefix_hit_adopts_the_window_or_shrinks() -> None:
    W, S = 8, 4
    cfg = SchedulerConfig(max_model_len=128, num_blocks=200, max_num_seqs=2, max_num_batched_tokens=64, block_size=S,
                          window=W, num_window_blocks=window_pool_blocks(W, S, 2, 64))
    sched = Scheduler(cfg)
    first = _seq(40)
    sched.add(first)
    out = sched.schedule()
    sched.update(out, {first.seq_id: 3})
    last_window = first.window_table[-3:]  # blocks 7..9 hold positions 28..39
    sched.finish(first.seq_id, "stop")
    turn = Sequence(first.all_token_ids + [11, 12, 13], SamplingParams(max_tokens=2))
    sched.add(turn)
    sched.schedule()
    # 41 known tokens: 10 full blocks hit; the window before position 40 starts at block 8
    assert turn.num_computed_tokens == 40
    assert turn.window_table[:8] == [NULL_BLOCK] * 8 and turn.window_table[8:10] == last_window[1:]


def test_a_hit_whose_window_was_evicted_is_recomputed() -> None:
    pool = WindowBlockPool(num_blocks=8, block_size=4, window=8)  # 7 blocks to hand out
    first = _seq(20)
    pool.allocate_for(first, 20)
    first.num_computed_tokens = 20
    pool.cache_full_blocks(first)
    pool.release_stale(first)  # blocks 0..2 (positions < 13) go back, hashed
    kept = first.window_table[3:]
    pool.free(first)
    again = _seq(21)  # the same 20 tokens and one more: 5 full blocks
    again.block_hashes = list(first.block_hashes)
    assert pool.usable_prefix(again, 5) == [NULL_BLOCK] * 3 + kept  # the window before position 20: blocks 3, 4
    pool.allocate_for(_seq(24, base=300), 24)  # 6 blocks from the front: 2 unused, blocks 0..2, then block 4
    assert pool.usable_prefix(again, 5) == []  # no whole window left before any block boundary


def _window_build(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path / "gpt_oss"
    return folder, build_tiny("gpt_oss", folder)  # sliding window 8 on every other layer


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_tokens_match_transformers(device: str, tmp_path: Path) -> None:
    """Prompts many windows long, four at once in 4-token blocks and 12-token steps: out-of-window
    blocks are reused while others still run, and the tokens equal transformers' (on CUDA through
    the decode graphs, which read the window tables too)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    folder, ref = _window_build(tmp_path)
    prompts = [[(i * 13 + j * 7) % 200 + 3 for i in range(n)] for j, n in enumerate((37, 5, 61, 23))]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    kw = dict(device=device, dtype="float32", block_size=4, max_num_batched_tokens=12, enforce_eager=device == "cpu")
    llm = LLM(str(folder), **kw)
    assert llm.engine.scheduler.window_pool is not None
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, params=params)]
    assert got == [hf_greedy(ref, p, 20) for p in prompts]
    # the window layers' caches are the small pool; the others hold the context
    runner = llm.engine.runner
    sizes = {a.window_pool: a.k_cache.shape[0] for a in runner.model.attention_layers()}
    assert sizes[True] == llm.engine.scheduler.config.num_window_blocks < sizes[False]


def test_an_agent_turn_reuses_its_prefix_through_the_window_pool(tmp_path: Path) -> None:
    folder, ref = _window_build(tmp_path)
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = [(i * 11) % 180 + 5 for i in range(45)]
    out = llm.generate(prompt_token_ids=[first], params=params)[0]
    turn = first + out.token_ids + [9, 8, 7, 6, 5]
    again = llm.generate(prompt_token_ids=[turn], params=params)[0]
    assert again.metrics.num_cached_tokens >= len(first)  # the conversation so far was not recomputed
    assert again.token_ids == hf_greedy(ref, turn, 12)


def test_scoring_more_than_the_window_pool_holds_says_so(tmp_path: Path) -> None:
    folder, _ = _window_build(tmp_path)
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, max_num_seqs=1, max_num_batched_tokens=8,
              max_model_len=256, enforce_eager=True)
    held = (llm.engine.scheduler.config.num_window_blocks - 1) * 4
    with pytest.raises(ConfigError, match=rf"sliding-window layers' pool holds {held}.*fewer or shorter"):
        llm.score([list(range(3, 3 + held + 40))])
    assert len(llm.score([list(range(3, 3 + held))])[0]) == held  # within the pool: scored
