"""The scheduler's data: its config, its output (the model runner's only input) and a layer-major
prefill job (engine/prefill_job.py admits one, engine/layer_prefill.py runs it).

Both the scheduler and its job mixin read these, so they live below both: no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferryman.prefill_steps import step_tokens
from ferryman.engine.sequence import Sequence
from ferryman.kvcache.window_pool import window_pool_need


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_model_len: int  # prompt + output tokens of one sequence
    num_blocks: int  # KV blocks in the pool
    max_num_seqs: int = 64  # sequences running at once
    # tokens computed in one step (prefill chunks + decodes); a last piece may take prefill_steps.prefill_tail more
    max_num_batched_tokens: int = 2048
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True
    window: int | None = None  # sliding window of the layers with a pool of their own (None: no such pool)
    num_window_blocks: int = 0  # blocks of that pool (at least window_pool_need)
    num_state_slots: int = 0  # linear-attention state slots (kvcache/state_pool.py); 0: no such layers
    num_state_checkpoints: int = 0  # their prefix-cache checkpoints (kvcache/state_checkpoints.py)
    blocks_per_page: int = 1  # main-pool blocks per page of a region shared with the experts
    num_layers: int = 1  # decoder layers (a layer-major job's steps count them)
    prefill_job_tokens: int = 0  # tokens of one layer-major prefill job (engine/prefill_job.py); 0: chunk-major

    def __post_init__(self) -> None:
        for name in ("max_model_len", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 1, got {value!r}")
        # A sequence alone in the pool must always fit, or it could never be (re)admitted.
        capacity = self.num_blocks * self.block_size
        if capacity < self.max_model_len:
            raise ValueError(f"KV pool holds {capacity} tokens ({self.num_blocks} blocks of "
                             f"{self.block_size}) < max_model_len={self.max_model_len}")
        if self.window is not None:  # a step must always find its window blocks
            steps = step_tokens(self.max_num_batched_tokens)
            need = window_pool_need(self.window, self.block_size, self.max_num_seqs, steps)
            if self.num_window_blocks < need:
                raise ValueError(f"the window pool has {self.num_window_blocks} blocks; window {self.window}, "
                                 f"{self.max_num_seqs} sequences and {steps}-token steps "
                                 f"need {need}")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence  # the sequence; its block_table already covers the new tokens
    num_tokens: int  # tokens computed this step (prefill chunk length, or 1 for a decode)
    start_pos: int  # position of the first of them == seq.num_computed_tokens before the step
    sample: bool  # True when the chunk reaches the last known token: sample the next one

    @property
    def token_ids(self) -> list[int]:
        """The token ids fed to the model for this sequence this step."""
        return self.seq.token_ids_slice(self.start_pos, self.start_pos + self.num_tokens)

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start_pos >= self.seq.num_prompt_tokens


@dataclass(slots=True)
class SchedulerOutput:
    # Sequences computed this step in the order their tokens are packed: running ones first,
    # then newly admitted ones. Prefill chunks and decodes are mixed.
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # Sum of num_tokens over `scheduled` (<= prefill_steps.step_tokens(max_num_batched_tokens)).
    num_batched_tokens: int = 0
    # Sequences preempted while building this step (their KV is gone; they will be recomputed).
    preempted: list[Sequence] = field(default_factory=list)
    # Hybrid models (kvcache/state_checkpoints.py): (checkpoint, state slot) copies to run before the
    # forward, (state slot, checkpoint) copies to run after it (the state at a chunk's end), and
    # (state slot, checkpoint, offset) saves of the state after the first `offset` tokens of that
    # slot's chunk (0 < offset < its num_tokens), which the linear-attention layers write during the
    # forward (layers/gated_deltanet.py).
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    state_saves_at: list[tuple[int, int, int]] = field(default_factory=list)
    # Layer-major prefill (engine/prefill_job.py): the job started this step (the runner builds its
    # inputs), how many of its layers run this step (after the job's previous ones, before the
    # scheduled sequences), and, on its last step, its sequences, which sample like scheduled ones.
    job_started: PrefillJob | None = None
    job_layers: int = 0
    job_finished: list[ScheduledSeq] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.job_layers

    @property
    def is_decode_only(self) -> bool:
        """Every sequence computes exactly one token (the case CUDA graphs capture)."""
        return all(s.num_tokens == 1 for s in self.scheduled)




@dataclass(slots=True)
class JobPiece:
    """The part of one sequence a job or one of its chunks computes."""

    seq: Sequence
    start_pos: int  # first position computed
    num_tokens: int  # tokens computed from there

    @property
    def end(self) -> int:
        return self.start_pos + self.num_tokens


@dataclass(slots=True)
class PrefillJob:
    members: list[JobPiece]  # one per sequence: all it computes, in admission order
    chunks: list[list[JobPiece]]  # the same tokens as chunk-major steps would pack them
    num_layers: int  # layers of the model
    layers_per_step: int  # the bound on layers run in a step that also decodes
    rings: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq_id -> (first block, ring blocks)
    layers_done: int = 0  # layers scheduled so far (all chunks of each)
    aborted: set[int] = field(default_factory=set)  # seq ids finished while the job ran

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.members)

    def take_layers(self, decoding: bool) -> int:
        """Layers to run this step: `layers_per_step` beside decodes, else all that are left."""
        left = self.num_layers - self.layers_done
        n = min(left, self.layers_per_step) if decoding else left
        self.layers_done += n
        return n

    @property
    def done(self) -> bool:
        return self.layers_done == self.num_layers
