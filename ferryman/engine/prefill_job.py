"""The scheduler's side of layer-major prefill: which prompts form a job, its chunks, its blocks.

A job takes prompts longer than one step (a chunk and its tail, prefill_steps.step_tokens; and the prompts
waiting behind them, up to the plan's `prefill_job_tokens`) out of the waiting queue at once. The
runner (engine/layer_prefill.py) then computes them layer by layer: layer l in every chunk, in chunk
order, before layer l + 1, so an offloaded expert crosses the link once per job and layer instead of
once per chunk.

Invariants:
- a job's sequences hold KV blocks for every token they compute from admission on (main pool),
  and in the window pool a ring of `ring_blocks` blocks (kvcache/window_pool.py `ring_table`):
  a layer-major job writes a window layer's KV of chunk c after chunk c - 1's at that layer only;
- they are in neither `waiting` nor `running` while the job runs: never preempted, never scheduled
  as chunks; their blocks are freed only when the job has finished (an abort waits for it), since
  the runner writes KV into them until then;
- chunks pack the job's tokens as chunk-major prefill would with no decode beside them (same
  pieces, same order), so both modes compute the same attention and MoE inputs;
- between two steps that decode, the job runs at most `layers_per_step` layers: no more
  token-layers than one chunk-major step of `max_num_batched_tokens` (the stall a decode sees).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ferryman.engine.sched_types import JobPiece, PrefillJob, SchedulerConfig, SchedulerOutput
from ferryman.engine.sequence import Sequence
from ferryman.kvcache.block_pool import BlockPool, cdiv
from ferryman.kvcache.state_pool import StatePool
from ferryman.kvcache.window_pool import WindowBlockPool
from ferryman.prefill_steps import piece_tokens, step_tokens


def ring_blocks(window: int, chunk: int, block_size: int) -> int:
    """Window-pool blocks a job's sequence cycles through: a chunk piece of at most `chunk` tokens
    reads its window and writes its own tokens, at most cdiv(chunk + window, S) + 2 blocks."""
    return cdiv(chunk + window, block_size) + 2


def pack_chunks(members: list[JobPiece], chunk: int) -> list[list[JobPiece]]:
    """Cut the members' tokens into steps of `chunk` tokens, in order, a member's last piece taking
    up to `prefill_tail(chunk)` more (chunk-major's packing, prefill_steps.piece_tokens)."""
    chunks: list[list[JobPiece]] = [[]]
    room = chunk
    for m in members:
        pos = m.start_pos
        while pos < m.end:
            if room <= 0:
                chunks.append([])
                room = chunk
            n = piece_tokens(m.end - pos, room, chunk)
            chunks[-1].append(JobPiece(m.seq, pos, n))
            pos += n
            room -= n
    return chunks


def layers_per_step(num_layers: int, chunk: int, job_tokens: int) -> int:
    """At most num_layers * chunk token-layers between two decode steps, at least one layer."""
    return max(1, num_layers * chunk // max(1, job_tokens))


class JobScheduling:
    """The Scheduler's job admission and bookkeeping (a mixin: engine/scheduler.py owns the state)."""

    config: SchedulerConfig
    pool: BlockPool
    window_pool: WindowBlockPool | None
    state_pool: StatePool | None
    waiting: deque[Sequence]
    running: list[Sequence]
    job: PrefillJob | None
    grow_kv: Callable[[int], bool] | None  # Scheduler's: expert slots back to KV (engine/memory_split.py)

    def _match(self, seq: Sequence) -> list[list[int]]: ...  # Scheduler's
    def free_blocks(self, seq: Sequence) -> None: ...  # Scheduler's

    def _start_job(self, out: SchedulerOutput) -> None:
        """Take the head of the queue and those behind it as a job when the head is longer than a step."""
        cfg = self.config
        if not cfg.prefill_job_tokens or not self.waiting or self.state_pool is not None:
            return
        head = self.waiting[0]
        if head.num_tokens - len(self._match(head)[0]) * cfg.block_size <= step_tokens(cfg.max_num_batched_tokens):
            return
        members: list[JobPiece] = []
        rings: dict[int, tuple[int, int]] = {}
        while self.waiting and len(self.running) + len(members) < cfg.max_num_seqs:
            seq = self.waiting[0]
            prefixes = self._match(seq)
            start = len(prefixes[0]) * cfg.block_size
            if sum(p.num_tokens for p in members) + seq.num_tokens - start > cfg.prefill_job_tokens:
                break
            ring = self._allocate_job(seq, seq.num_tokens - start, prefixes)
            if ring is None:
                break
            self._admit_to_job(seq)
            members.append(JobPiece(seq, start, seq.num_tokens - start))
            rings[seq.seq_id] = (len(prefixes[0]), ring)
        if not members:
            return
        chunk = cfg.max_num_batched_tokens
        total = sum(p.num_tokens for p in members)
        self.job = PrefillJob(members, pack_chunks(members, chunk), cfg.num_layers,
                              layers_per_step(cfg.num_layers, chunk, total), rings)
        out.job_started = self.job

    def _allocate_job(self, seq: Sequence, num_tokens: int, prefixes: list[list[int]]) -> int | None:
        """Blocks of a job's sequence: all its tokens in the main pool, a ring in the window pool.
        Returns the ring's blocks (0 without a window pool), None when a pool is short."""
        cfg = self.config
        grants = [(self.pool, num_tokens, prefixes[0])]
        ring = 0
        if self.window_pool is not None:
            ring = min(ring_blocks(self.window_pool.window, step_tokens(cfg.max_num_batched_tokens), cfg.block_size),
                       cdiv(num_tokens, cfg.block_size))
            grants.append((self.window_pool, min(num_tokens, ring * cfg.block_size), prefixes[1]))
        short = self.pool.shortfall(seq, num_tokens, prefixes[0])
        if short and self.grow_kv is not None:  # idle KV pages lent to the experts come back
            self.grow_kv(len(self.pool.free_queue) + short)
        if not all(pool.can_allocate(seq, n, prefix) for pool, n, prefix in grants):
            return None
        for pool, n, prefix in grants:  # the main pool first: it sets seq.num_computed_tokens
            pool.grow(seq, n, prefix)
        return ring

    def _admit_to_job(self, seq: Sequence) -> None:
        self.waiting.popleft()
        seq.mark_running()

    def _advance_job(self, out: SchedulerOutput) -> list[JobPiece]:
        """This step's share of the running job; the pieces that sample when it is done, else []."""
        job = self.job
        if job is None:
            return []
        out.job_layers = job.take_layers(decoding=bool(out.scheduled))
        return job.members if job.done else []

    def _finish_job(self) -> None:
        """The job's last layer ran: its sequences join `running` (their window rings folded into
        ordinary window tables), or, aborted meanwhile, give their blocks back now."""
        job, self.job = self.job, None
        assert job is not None
        for m in job.members:
            if m.seq.seq_id in job.aborted:
                self.free_blocks(m.seq)
                continue
            if self.window_pool is not None:
                first, ring = job.rings[m.seq.seq_id]
                self.window_pool.fold_ring(m.seq, first, ring, m.end)
            self.running.append(m.seq)

    def _abort_in_job(self, seq_id: int) -> Sequence | None:
        """A job's sequence finished early: it is marked now, its blocks go back when the job ends."""
        job = self.job
        for m in job.members if job is not None else ():
            if m.seq.seq_id == seq_id and seq_id not in job.aborted:
                job.aborted.add(seq_id)
                return m.seq
        return None
