"""Continuous-batching scheduler with chunked prefill, prefix caching and recompute preemption.

Each step the scheduler decides which sequences run and how many of their tokens are computed;
`SchedulerOutput` is the only thing the model runner sees. Policy:
  1. running sequences first, oldest admission first: a decode takes 1 token, a sequence still in
     prefill takes its next chunk (as much as the token budget leaves; its last piece may run past
     the budget by `prefill_steps.prefill_tail` tokens, so no step computes a tail of a few tokens alone);
  2. when a running sequence needs a block and the pool is empty, the most recently admitted
     running sequence is preempted (blocks freed, back to the front of the waiting queue, its
     tokens recomputed when readmitted); a sequence with nobody behind it preempts itself;
  3. if nothing was preempted, waiting sequences are admitted FCFS while the token budget, the
     sequence limit and the pool allow; the last one admitted may get only a chunk of its prompt.
With a window pool (sliding-window layers, kvcache/window_pool.py) a sequence gets blocks in both
pools or in neither; its out-of-window blocks go back after every step. With a region shared with
the expert cache (engine/memory_split.py) the main pool first asks `grow_kv` for the blocks it lacks
(expert slots become KV pages) and preempts only when that fails.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from ferryman.engine.prefill_job import JobScheduling
from ferryman.engine.sched_types import PrefillJob, ScheduledSeq, SchedulerConfig, SchedulerOutput
from ferryman.engine.sequence import FinishReason, Sequence, SequenceStatus
from ferryman.kvcache.block_pool import BlockPool
from ferryman.kvcache.state_checkpoints import CheckpointIndex, checkpoint_positions
from ferryman.kvcache.state_pool import StatePool
from ferryman.kvcache.window_pool import WindowBlockPool
from ferryman.prefill_steps import piece_tokens


class Scheduler(JobScheduling):
    def __init__(self, config: SchedulerConfig, eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pool = BlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching,
                              config.blocks_per_page)
        # the main pool's free blocks can grow (a shared region: engine/memory_split.py): n -> done
        self.grow_kv: Callable[[int], bool] | None = None
        self.window_pool = None if config.window is None else \
            WindowBlockPool(config.num_window_blocks, config.block_size, config.window, config.enable_prefix_caching)
        # Invariant: a sequence holds blocks in every pool or in none.
        self.pools: list[BlockPool] = [self.pool] if self.window_pool is None else [self.pool, self.window_pool]
        # Invariant: a sequence holds a state slot iff it holds blocks (hybrid models only).
        self.state_pool = StatePool(config.num_state_slots) if config.num_state_slots else None
        self.checkpoints = CheckpointIndex(config.num_state_checkpoints) \
            if self.state_pool is not None and config.enable_prefix_caching and config.num_state_checkpoints else None
        self.waiting: deque[Sequence] = deque()
        # Invariant: running is in admission order (the last one is preempted first).
        self.running: list[Sequence] = []
        self.job: PrefillJob | None = None  # the layer-major prefill running (engine/prefill_job.py)
        self.num_preemptions = 0

    # ---- queue management --------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        limit = self.config.max_model_len
        if seq.num_prompt_tokens > limit:
            raise ValueError(f"prompt of seq {seq.seq_id} has {seq.num_prompt_tokens} tokens, "
                             f"more than max_model_len={limit}")
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"seq {seq.seq_id} was already scheduled (status {seq.status.name})")
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.job)

    def finish(self, seq_id: int, reason: FinishReason) -> Sequence | None:
        """Finish a waiting or running sequence now (stop string seen, client gone, ...).
        Returns it, or None when no unfinished sequence has this id."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self._finish(seq, reason)
                    return seq
        seq = self._abort_in_job(seq_id)  # its blocks go back when the job ends
        if seq is not None:
            seq.mark_finished(reason)
        return seq

    def free_blocks(self, seq: Sequence) -> None:
        for pool in self.pools:
            pool.free(seq)
        if self.state_pool is not None:
            self.state_pool.free(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.free_blocks(seq)
        seq.mark_finished(reason)

    # ---- scheduling --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if self.job is None and not out.preempted:
            self._start_job(out)
            if self.job is None:  # no admission beside a job: its prompts go first (FCFS)
                budget = self._schedule_waiting(out, budget)
        out.job_finished = [ScheduledSeq(p.seq, p.num_tokens, p.start_pos, True) for p in self._advance_job(out)
                            if not p.seq.is_finished]  # aborted while the job ran: no sample
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            start = seq.num_computed_tokens
            num_tokens = piece_tokens(seq.num_tokens - start, budget, self.config.max_num_batched_tokens)
            if not self._allocate_or_preempt(seq, num_tokens, out):
                break  # seq preempted itself: everything behind it is gone too
            out.scheduled.append(self._scheduled(seq, num_tokens))
            self._save_checkpoints(out.scheduled[-1], out)
            budget -= num_tokens
            i += 1
        return budget

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        # Victims come from the back of `running`, behind `seq`, so none was scheduled yet.
        while not self.allocate_blocks(seq, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def allocate_blocks(self, seq: Sequence, num_tokens: int, prefixes: list[list[int]] | None = None) -> bool:
        """Blocks for `num_tokens` more tokens of `seq` in every pool, or (False) in none.
        prefixes: at admission, the cached blocks it adopts in each pool (`_match`)."""
        if self.window_pool is not None:
            self.window_pool.release_stale(seq)
        grants = list(zip(self.pools, prefixes or [None] * len(self.pools)))
        short = self.pool.shortfall(seq, num_tokens, grants[0][1])
        if short and self.grow_kv is not None:
            self.grow_kv(len(self.pool.free_queue) + short)
        if not all(pool.can_allocate(seq, num_tokens, prefix) for pool, prefix in grants):
            return False
        if self.state_pool is not None and not self.state_pool.allocate(seq):
            return False
        for pool, prefix in grants:  # the main pool first: it sets seq.num_computed_tokens
            pool.grow(seq, num_tokens, prefix)
        return True

    def _match(self, seq: Sequence) -> list[list[int]]:
        """The cached prefix `seq` adopts in each pool: main-pool blocks, and the window pool's
        table for the window before its end (the hit shrinks to what that pool still holds)."""
        prefix = self.pool.match_sequence(seq)
        if self.state_pool is not None:  # cached KV without the linear layers' state is no hit
            prefix = prefix[:self._checkpointed(seq, len(prefix))]
        if self.window_pool is None:
            return [prefix]
        window_prefix = self.window_pool.usable_prefix(seq, len(prefix))
        return [prefix[:len(window_prefix)], window_prefix]

    def _preempt(self, seq: Sequence) -> None:
        self.free_blocks(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            prefixes = self._match(seq)
            start = len(prefixes[0]) * self.config.block_size
            num_tokens = piece_tokens(seq.num_tokens - start, budget, self.config.max_num_batched_tokens)
            if not self.allocate_blocks(seq, num_tokens, prefixes):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if self.checkpoints is not None and prefixes[0]:  # the state after the adopted prefix
                checkpoint = self.checkpoints.use(seq.block_hashes[len(prefixes[0]) - 1])
                out.state_restores.append((checkpoint, seq.state_slot))
            seq.mark_running()
            self.running.append(seq)
            out.scheduled.append(self._scheduled(seq, num_tokens))
            self._save_checkpoints(out.scheduled[-1], out)
            budget -= num_tokens
        return budget

    # ---- state checkpoints of hybrid models (kvcache/state_checkpoints.py) -------------------

    def _checkpointed(self, seq: Sequence, num_blocks: int) -> int:
        """The longest prefix of at most num_blocks cached blocks whose state is checkpointed."""
        if self.checkpoints is None:
            return 0
        for n in range(num_blocks, 0, -1):
            if self.checkpoints.find(seq.block_hashes[n - 1]) is not None:
                return n
        return 0

    def _positions(self, seq: Sequence) -> list[int]:
        return checkpoint_positions(seq.num_prompt_tokens, self.config.block_size, seq.params.message_ends)

    def _save_checkpoints(self, s: ScheduledSeq, out: SchedulerOutput) -> None:
        """Save the state at each checkpoint position this chunk reaches (once per prefix): after the
        forward where the chunk ends there, else from inside the chunk, so a chunk never stops early."""
        if self.checkpoints is None:
            return
        end = s.start_pos + s.num_tokens
        for at in self._positions(s.seq):
            prefix_hash = s.seq.block_hashes[at // self.config.block_size - 1]
            if not s.start_pos < at <= end or self.checkpoints.find(prefix_hash) is not None:
                continue
            checkpoint = self.checkpoints.reserve(prefix_hash)
            if at == end:
                out.state_saves.append((s.seq.state_slot, checkpoint))
            else:
                out.state_saves_at.append((s.seq.state_slot, checkpoint, at - s.start_pos))

    @staticmethod
    def _scheduled(seq: Sequence, num_tokens: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(seq, num_tokens, start, start + num_tokens == seq.num_tokens)

    # ---- after the step ----------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """Record a finished step: advance computed tokens, append sampled tokens, stop sequences.
        `sampled` maps seq_id -> token id for every scheduled sequence with `sample` set.
        Must run before the next schedule(). Returns the sequences that finished in this step."""
        now = time.monotonic()
        finished = []
        if self.job is not None and self.job.done:
            self._finish_job()
        for s in [*output.job_finished, *output.scheduled]:
            seq = s.seq
            if seq.is_finished:
                continue  # aborted while the step ran; its blocks are already free
            seq.num_computed_tokens += s.num_tokens
            for pool in self.pools:  # registered before the release: released blocks stay adoptable
                pool.cache_full_blocks(seq)
            if self.window_pool is not None:
                self.window_pool.release_stale(seq)
            if not s.sample:
                continue
            if seq.seq_id not in sampled:
                raise ValueError(f"no sampled token for seq {seq.seq_id}, which sampled this step")
            seq.append_token(sampled[seq.seq_id], now)
            reason = self._stop_reason(seq)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence) -> FinishReason | None:
        token = seq.output_token_ids[-1]
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    # ---- stats -------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block that no sequence holds, in every pool."""
        for pool in self.pools:
            pool.reset_prefix_cache()
        if self.checkpoints is not None:
            self.checkpoints.clear()

    def stats(self) -> dict[str, float]:
        return {
            "num_running": len(self.running) + (len(self.job.members) if self.job is not None else 0),
            "num_waiting": len(self.waiting),
            "kv_usage": self.pool.usage,
            "prefix_hit_rate": self.pool.prefix_hit_rate,
            "num_preemptions": self.num_preemptions,
        }
