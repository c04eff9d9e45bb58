"""Scheduler tests driven by a fake model runner with a fake paged KV cache.

The fake runner writes each computed token id into kv[block][offset] through the sequence's block
table, then reads positions 0..end back and checks they equal the sequence's tokens: any mistake in
block tables, positions, prefix hits or preemption shows up as a wrong read-back. The "model"
output is a function of the tokens read back, so a recomputed sequence yields the same tokens.
"""

import pytest

from ferryman.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from ferryman.engine.sequence import Sequence, SequenceStatus
from ferryman.prefill_steps import piece_tokens, pieces_of, step_tokens
from ferryman.sampling_params import SamplingParams

EOS = 2


class FakeRunner:
    def __init__(self, config: SchedulerConfig) -> None:
        self.S = config.block_size
        self.kv = [[-1] * config.block_size for _ in range(config.num_blocks)]

    def step(self, out: SchedulerOutput) -> dict[int, int]:
        sampled = {}
        for s in out.scheduled:
            seq, table = s.seq, s.seq.block_table
            for pos, tok in zip(range(s.start_pos, s.start_pos + s.num_tokens), s.token_ids):
                self.kv[table[pos // self.S]][pos % self.S] = tok
            end = s.start_pos + s.num_tokens
            seen = [self.kv[table[p // self.S]][p % self.S] for p in range(end)]
            assert seen == seq.all_token_ids[:end], f"KV of seq {seq.seq_id} is corrupted"
            if s.sample:
                sampled[seq.seq_id] = 10 + (sum(seen) * 31 + len(seen)) % 1000  # never EOS
        return sampled


def make_config(**kw) -> SchedulerConfig:
    base = dict(max_model_len=256, num_blocks=64, block_size=4, max_num_batched_tokens=64)
    return SchedulerConfig(**(base | kw))


def make_seq(n_prompt: int, max_tokens: int = 8, start: int = 100, **kw) -> Sequence:
    return Sequence(list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, **kw))


def run_to_end(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> list[SchedulerOutput]:
    outputs = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.is_empty, "scheduler stalled"
        sched.update(out, runner.step(out))
        outputs.append(out)
        assert len(outputs) < max_steps
    return outputs


def plan(out: SchedulerOutput) -> list[tuple[int, int, int, bool]]:
    return [(s.seq.seq_id, s.start_pos, s.num_tokens, s.sample) for s in out.scheduled]


def test_chunked_prefill_mixes_with_decodes():
    cfg = make_config(max_num_batched_tokens=16)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    a = make_seq(4, max_tokens=10)
    sched.add(a)
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 0, 4, True)]
    sched.update(out, runner.step(out))
    b = make_seq(40, start=500)
    sched.add(b)
    plans = []
    for _ in range(3):
        out = sched.schedule()
        plans.append(plan(out))
        assert out.num_batched_tokens <= 16
        sched.update(out, runner.step(out))
    assert plans == [
        [(a.seq_id, 4, 1, True), (b.seq_id, 0, 15, False)],
        [(a.seq_id, 5, 1, True), (b.seq_id, 15, 15, False)],
        [(a.seq_id, 6, 1, True), (b.seq_id, 30, 10, True)],
    ]
    assert b.num_output_tokens == 1 and a.num_output_tokens == 4
    run_to_end(sched, runner)


def test_a_prompt_a_few_tokens_past_a_chunk_takes_one_step():
    """A prompt's last piece takes up to chunk // 32 tokens past what the step has left
    (prefill_steps.piece_tokens): with 64-token chunks, 66 tokens alone run in one step; beside a decode
    (63 left) 67 tokens run as 63 + 4, and 64 beside two decodes (62 left) in one step. No step
    computes more than step_tokens(64) = 66 tokens."""
    cfg = make_config(max_num_batched_tokens=64, max_model_len=128, num_blocks=128)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    a, b, c = make_seq(66, max_tokens=20), make_seq(67, max_tokens=20, start=300), make_seq(64, start=600)
    plans = []

    def step() -> None:
        out = sched.schedule()
        assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled) <= step_tokens(64) == 66
        plans.append(plan(out))
        sched.update(out, runner.step(out))

    sched.add(a)
    step()
    sched.add(b)
    step()
    step()
    sched.add(c)
    step()
    assert plans == [
        [(a.seq_id, 0, 66, True)],
        [(a.seq_id, 66, 1, True), (b.seq_id, 0, 63, False)],
        [(a.seq_id, 67, 1, True), (b.seq_id, 63, 4, True)],
        [(a.seq_id, 68, 1, True), (b.seq_id, 67, 1, True), (c.seq_id, 0, 64, True)],
    ]
    run_to_end(sched, runner)


def test_pieces_of_a_prompt_are_what_piece_tokens_cuts():
    """`pieces_of` (ferryman plan's model of a prompt's chunks) agrees with cutting by `piece_tokens`."""
    for chunk in (16, 64, 4096):
        for tokens in (1, chunk - 1, chunk, chunk + 1, chunk + chunk // 32, chunk + chunk // 32 + 1, 3 * chunk + 2):
            cut, left = [], tokens
            while left:
                cut.append(piece_tokens(left, chunk, chunk))
                left -= cut[-1]
            full, rest = pieces_of(tokens, chunk)
            assert cut == [chunk] * full + ([rest] if rest else []), (chunk, tokens, cut)


def test_preemption_recomputes_and_finishes_with_the_same_tokens():
    # Reference: each sequence alone in a large pool.
    ref_cfg = make_config()
    ref = {}
    for start in (100, 300):
        sched = Scheduler(ref_cfg)
        seq = make_seq(10, max_tokens=20, start=start)
        sched.add(seq)
        run_to_end(sched, FakeRunner(ref_cfg))
        ref[start] = seq.output_token_ids
    # 10 blocks of 4 = 40 tokens; the two sequences need 30 tokens each at the end.
    cfg = make_config(num_blocks=10, max_model_len=40)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    a, b = make_seq(10, max_tokens=20, start=100), make_seq(10, max_tokens=20, start=300)
    sched.add(a)
    sched.add(b)
    outputs = run_to_end(sched, runner)
    preempted = [s.seq_id for out in outputs for s in out.preempted]
    assert preempted and set(preempted) == {b.seq_id}  # the later admission is the victim
    assert b.num_preemptions == len(preempted) and sched.num_preemptions == len(preempted)
    assert a.output_token_ids == ref[100] and b.output_token_ids == ref[300]
    assert a.finish_reason == b.finish_reason == "length"
    assert len(sched.pool.free_queue) == cfg.num_blocks


def test_preempted_sequence_goes_to_the_front_of_waiting():
    cfg = make_config(num_blocks=4, max_model_len=16)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    a, b, c = (make_seq(7, max_tokens=8, start=100 * i) for i in (1, 2, 3))
    for seq in (a, b, c):
        sched.add(seq)
    out = sched.schedule()  # a and b take 2 blocks each; c waits
    assert plan(out) == [(a.seq_id, 0, 7, True), (b.seq_id, 0, 7, True)]
    sched.update(out, runner.step(out))
    out = sched.schedule()  # a, b decode into their second block: fits
    sched.update(out, runner.step(out))
    out = sched.schedule()  # a writes position 8, in a third block: b is preempted
    assert [s.seq_id for s in out.preempted] == [b.seq_id]
    assert plan(out) == [(a.seq_id, 8, 1, True)]
    assert b.status is SequenceStatus.PREEMPTED and b.block_table == []
    assert list(sched.waiting) == [b, c]


def test_max_num_seqs_is_respected():
    cfg = make_config(max_num_seqs=2)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    seqs = [make_seq(5, max_tokens=3, start=100 * i) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    outputs = run_to_end(sched, runner)
    assert max(len(out.scheduled) for out in outputs) == 2
    assert all(seq.num_output_tokens == 3 for seq in seqs)
    # FCFS: sequences finish in arrival order pairs.
    assert sorted(seqs, key=lambda s: s.finished_time) == seqs


def test_prefix_cache_hit_skips_cached_tokens():
    cfg = make_config()
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    a = make_seq(18, max_tokens=2)
    sched.add(a)
    run_to_end(sched, runner)
    b = Sequence(list(range(100, 116)) + [7, 8, 9], SamplingParams(max_tokens=2))
    sched.add(b)
    out = sched.schedule()
    # 16 shared tokens = 4 full blocks; all 4 are cached and none is b's last token.
    assert plan(out) == [(b.seq_id, 16, 3, True)]
    assert b.num_cached_tokens == 16 and b.block_table[:4] == a_blocks_of(sched, a)
    sched.update(out, runner.step(out))
    run_to_end(sched, runner)
    assert sched.pool.hit_tokens == 16


def a_blocks_of(sched: Scheduler, seq: Sequence) -> list[int]:
    """Block ids now cached for the first four full blocks of `seq`."""
    return [sched.pool.cached[h] for h in seq.block_hashes[:4]]


def test_identical_prompt_recomputes_only_the_last_token():
    cfg = make_config()
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    a, b = make_seq(16, max_tokens=1), make_seq(16, max_tokens=1)
    sched.add(a)
    run_to_end(sched, runner)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == [(b.seq_id, 12, 4, True)]  # last block recomputed: it holds the last token
    sched.update(out, runner.step(out))
    assert b.output_token_ids == a.output_token_ids


def test_finished_sequences_free_their_blocks():
    cfg = make_config(enable_prefix_caching=False)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    seqs = [make_seq(9, max_tokens=4, start=100 * i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    sched.update(out, runner.step(out))
    assert len(sched.pool.free_queue) == cfg.num_blocks - 3 * 3
    run_to_end(sched, runner)
    assert len(sched.pool.free_queue) == cfg.num_blocks and sched.pool.usage == 0.0
    assert all(s.block_table == [] and s.status is SequenceStatus.FINISHED for s in seqs)


@pytest.mark.parametrize("kw, steps, reason", [
    (dict(), 1, "stop"),  # EOS
    (dict(ignore_eos=True), 5, "length"),
    (dict(ignore_eos=True, stop_token_ids=[77]), 2, "stop"),
])
def test_stop_conditions(kw, steps, reason):
    cfg = make_config()
    sched = Scheduler(cfg, eos_token_ids=[EOS])
    seq = make_seq(3, max_tokens=5, **kw)
    sched.add(seq)
    tokens = iter([EOS, 77, 5, 6, 7, 8])
    for step in range(1, 10):
        out = sched.schedule()
        done = sched.update(out, {seq.seq_id: next(tokens)})
        if done:
            break
    assert done == [seq] and step == steps and seq.finish_reason == reason
    assert seq.finished_time is not None and seq.first_token_time is not None


def test_max_model_len_stops_with_length():
    cfg = make_config(max_model_len=6)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    seq = make_seq(4, max_tokens=100)
    sched.add(seq)
    run_to_end(sched, runner)
    assert seq.num_tokens == 6 and seq.finish_reason == "length"


def test_add_rejects_prompt_longer_than_max_model_len():
    sched = Scheduler(make_config(max_model_len=8))
    with pytest.raises(ValueError, match=r"9.*max_model_len=8"):
        sched.add(make_seq(9))


def test_abort_and_finish_free_blocks():
    cfg = make_config()
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    a, b, c = make_seq(5), make_seq(5, start=300), make_seq(5, start=500)
    for seq in (a, b, c):
        sched.add(seq)
    out = sched.schedule()
    sampled = runner.step(out)
    assert sched.finish(b.seq_id, "abort") is b  # aborted before its step is recorded: update skips it
    assert sched.update(out, sampled) == []
    assert b.finish_reason == "abort" and b.output_token_ids == []
    assert sched.finish(c.seq_id, "stop") is c and c.finish_reason == "stop"
    assert sched.finish(12345, "abort") is None
    assert len(sched.pool.free_queue) == cfg.num_blocks - 2
    assert plan(sched.schedule()) == [(a.seq_id, 5, 1, True)]


def test_missing_sampled_token_is_an_error():
    sched = Scheduler(make_config())
    seq = make_seq(3)
    sched.add(seq)
    out = sched.schedule()
    with pytest.raises(ValueError, match=f"seq {seq.seq_id}"):
        sched.update(out, {})


@pytest.mark.parametrize("kw, match", [
    (dict(num_blocks=3, block_size=4, max_model_len=13), "13"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(block_size=0), "block_size"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        make_config(**kw)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_workload_matches_solo_runs(prefix_caching):
    """Shared prefixes, a tight pool, a small token budget: every sequence must produce exactly
    what it produces alone, and the fake KV read-back must hold at every step."""
    import random
    rng = random.Random(0)
    shared = [rng.randrange(10, 1000) for _ in range(24)]
    specs = []
    for i in range(12):
        tail = [rng.randrange(10, 1000) for _ in range(rng.randrange(1, 20))]
        specs.append((shared[:rng.randrange(0, 24)] + tail, rng.randrange(1, 16)))

    def run(cfg: SchedulerConfig, batch: list[tuple[list[int], int]]
            ) -> tuple[list[list[int]], Scheduler]:
        sched, runner = Scheduler(cfg), FakeRunner(cfg)
        seqs = [Sequence(p, SamplingParams(max_tokens=m)) for p, m in batch]
        for seq in seqs:
            sched.add(seq)
        run_to_end(sched, runner)
        return [s.output_token_ids for s in seqs], sched

    solo_cfg = make_config(enable_prefix_caching=False)
    expected = [run(solo_cfg, [spec])[0][0] for spec in specs]
    cfg = make_config(num_blocks=16, max_model_len=64, max_num_batched_tokens=12,
                      max_num_seqs=6, enable_prefix_caching=prefix_caching)
    got, sched = run(cfg, specs)
    assert got == expected
    assert sched.num_preemptions > 0
    assert (sched.pool.hit_tokens > 0) == prefix_caching
    assert len(sched.pool.free_queue) == cfg.num_blocks
