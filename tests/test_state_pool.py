"""The state pool and prefix checkpoints of hybrid models, driven by a fake runner.

The fake runner's "state" of a slot is the list of tokens it has consumed; before each chunk it
checks that the slot holds exactly the sequence's tokens before the chunk's start (a fresh start
reads an empty state), so a wrong slot, a missed restore or a stale checkpoint shows up at once.
"""

from __future__ import annotations

from ferryman.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from ferryman.engine.sequence import Sequence
from ferryman.kvcache.state_checkpoints import CheckpointIndex, checkpoint_position
from ferryman.kvcache.state_pool import StatePool
from ferryman.sampling_params import SamplingParams


class FakeStateRunner:
    def __init__(self, config: SchedulerConfig) -> None:
        self.slots: list[list[int]] = [[] for _ in range(config.num_state_slots)]
        self.saved: list[list[int]] = [[] for _ in range(config.num_state_checkpoints)]

    def step(self, out: SchedulerOutput) -> dict[int, int]:
        for ckpt, slot in out.state_restores:
            self.slots[slot] = list(self.saved[ckpt])
        sampled = {}
        for s in out.scheduled:
            state = [] if s.start_pos == 0 else self.slots[s.seq.state_slot]
            assert state == s.seq.all_token_ids[:s.start_pos], f"state of seq {s.seq.seq_id} is wrong"
            self.slots[s.seq.state_slot] = state + s.token_ids
            if s.sample:
                sampled[s.seq.seq_id] = 10 + (sum(self.slots[s.seq.state_slot]) * 31) % 1000
        for slot, ckpt, offset in out.state_saves_at:  # the state inside the chunk: tokens before the offset
            s = next(s for s in out.scheduled if s.seq.state_slot == slot)
            self.saved[ckpt] = s.seq.all_token_ids[:s.start_pos + offset]
        for slot, ckpt in out.state_saves:
            self.saved[ckpt] = list(self.slots[slot])
        return sampled


def make(**kw) -> tuple[Scheduler, FakeStateRunner]:
    cfg = SchedulerConfig(**(dict(max_model_len=256, num_blocks=64, block_size=4, max_num_batched_tokens=64,
                                  num_state_slots=4, num_state_checkpoints=8) | kw))
    return Scheduler(cfg), FakeStateRunner(cfg)


def run(sched: Scheduler, runner: FakeStateRunner, seqs: list[Sequence]) -> list[SchedulerOutput]:
    for seq in seqs:
        sched.add(seq)
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, runner.step(out))
        outs.append(out)
    return outs


def seq(tokens: list[int], max_tokens: int = 3) -> Sequence:
    return Sequence(tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_checkpoint_position() -> None:
    assert [checkpoint_position(n, 4) for n in (1, 4, 5, 8, 9, 10)] == [0, 0, 4, 4, 8, 8]


def test_next_turn_restores_the_checkpoint_and_prefills_the_tail() -> None:
    sched, runner = make()
    first = seq(list(range(100, 110)))
    outs = run(sched, runner, [first])
    assert [(s.start_pos, s.num_tokens) for s in outs[0].scheduled] == [(0, 10)]  # runs past the checkpoint
    assert outs[0].state_saves_at == [(0, 0, 8)] and outs[0].state_saves == [] and not outs[1].state_saves_at
    turn2 = seq(first.all_token_ids + [7, 8, 9, 11, 12])
    outs = run(sched, runner, [turn2])
    assert outs[0].state_restores == [(0, 0)]  # checkpoint 0 into slot 0 (freed by the first turn)
    assert outs[0].scheduled[0].start_pos == 8 and turn2.num_cached_tokens == 8
    # turn 2's own checkpoint (at 16) is saved from inside its one chunk
    assert outs[0].scheduled[0].num_tokens == len(turn2.prompt_token_ids) - 8
    assert outs[0].state_saves_at == [(0, 1, 16 - 8)]


def test_one_chunk_saves_at_several_positions_and_a_branch_restores_one() -> None:
    sched, runner = make()
    first = Sequence(list(range(100, 122)), SamplingParams(max_tokens=2, ignore_eos=True, message_ends=[9, 17]))
    outs = run(sched, runner, [first])  # checkpoints at 8, 16 (message ends) and 20 (the prompt's)
    assert [(s.start_pos, s.num_tokens) for s in outs[0].scheduled] == [(0, 22)]
    assert outs[0].state_saves_at == [(0, 0, 8), (0, 1, 16), (0, 2, 20)] and not outs[0].state_saves
    branch = seq(list(range(100, 117)) + [5, 6, 7])  # shares the first two messages, then differs
    outs = run(sched, runner, [branch])
    assert outs[0].state_restores == [(1, 0)] and branch.num_cached_tokens == 16  # the runner checked the state


def test_a_chunk_ending_at_a_checkpoint_saves_after_the_forward() -> None:
    sched, runner = make(max_num_batched_tokens=8)
    outs = run(sched, runner, [seq(list(range(100, 118)))])  # checkpoint at 16: the second chunk ends there
    assert [(o.scheduled[0].num_tokens, o.state_saves, o.state_saves_at) for o in outs[:3]] == \
        [(8, [], []), (8, [(0, 0)], []), (2, [], [])]


def test_cached_kv_without_a_checkpoint_is_recomputed() -> None:
    sched, runner = make()
    run(sched, runner, [seq(list(range(100, 118)))])  # checkpoint at 16 only; blocks 0..4 cached
    other = seq(list(range(100, 110)))  # shares blocks 0, 1 (no checkpoint at 8)
    outs = run(sched, runner, [other])
    assert outs[0].state_restores == [] and outs[0].scheduled[0].start_pos == 0 and other.num_cached_tokens == 0


def test_slots_come_back_after_finish_and_preemption() -> None:
    sched, runner = make(num_blocks=12, num_state_slots=3, max_model_len=40)
    seqs = [seq(list(range(100 + 10 * i, 109 + 10 * i)), max_tokens=12) for i in range(5)]
    run(sched, runner, seqs)
    assert sched.num_preemptions > 0, "the pool was meant to run short"
    assert sched.state_pool is not None and sched.state_pool.num_free == 3
    assert all(s.state_slot == -1 for s in seqs)


def test_no_checkpoints_without_prefix_caching() -> None:
    sched, runner = make(enable_prefix_caching=False)
    outs = run(sched, runner, [seq(list(range(100, 110)))])
    assert sched.checkpoints is None and outs[0].scheduled[0].num_tokens == 10
    assert all(not o.state_saves and not o.state_saves_at and not o.state_restores for o in outs)


def test_checkpoint_index_evicts_the_least_recently_used() -> None:
    index = CheckpointIndex(2)
    assert index.reserve(b"a") == 0 and index.reserve(b"b") == 1
    assert index.use(b"a") == 0  # a is now the most recent
    assert index.reserve(b"c") == 1 and index.find(b"b") is None and index.find(b"a") == 0
    index.clear()
    assert index.find(b"a") is None and sorted(index.free) == [0, 1]


def test_state_pool_hands_out_and_takes_back() -> None:
    pool, a, b = StatePool(2), seq([1]), seq([2])
    assert pool.allocate(a) and pool.allocate(b) and (a.state_slot, b.state_slot) == (0, 1)
    assert not pool.allocate(seq([3]))
    pool.free(a)
    assert pool.num_free == 1 and a.state_slot == -1
