"""One request's tokens and bookkeeping state as it moves through the scheduler."""

from __future__ import annotations

import enum
import itertools
import time
from typing import Literal

import torch

from ferryman.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks
    RUNNING = "running"  # admitted, holds KV blocks, scheduled every step it fits
    PREEMPTED = "preempted"  # lost its blocks; back in the waiting queue, will be recomputed
    FINISHED = "finished"  # done (see finish_reason); holds no blocks


class Sequence:
    """Prompt + generated tokens of one request.

    Invariants:
      - tokens [0, num_computed_tokens) have their KV written in the blocks of `block_table`
        (and, for sliding-window layers with a pool of their own, of `window_table` where their
        window still reaches: kvcache/window_pool.py);
      - num_computed_tokens < num_tokens unless the sequence is finished (the newest token is
        always still to be fed to the model);
      - block_hashes[i] is the prefix-cache hash of tokens [0, (i + 1) * block_size); it depends only
        on token ids, so it stays valid across preemption.
    Times come from time.monotonic() (seconds), for latency metrics only.
    """

    __slots__ = (
        "seq_id", "prompt_token_ids", "output_token_ids", "params", "status", "finish_reason",
        "num_computed_tokens", "block_table", "window_table", "state_slot", "block_hashes", "num_cached_tokens",
        "num_preemptions", "arrival_time", "first_scheduled_time", "first_token_time", "finished_time", "_generator",
    )

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must hold at least one token")
        self.seq_id: int = next(_seq_ids)
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params: SamplingParams = params if params is not None else SamplingParams()
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens: int = 0
        self.block_table: list[int] = []
        self.window_table: list[int] = []  # the sliding-window layers' blocks (kvcache/window_pool.py)
        self.state_slot: int = -1  # linear-attention layers' state (kvcache/state_pool.py); -1: none
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
        self.num_preemptions: int = 0
        self.arrival_time: float = time.monotonic()
        self.first_scheduled_time: float | None = None  # first admitted to a step (queueing ends)
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self._generator: torch.Generator | None = None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.name}, prompt={self.num_prompt_tokens},"
                f" output={self.num_output_tokens}, computed={self.num_computed_tokens})")

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n_prompt]

    def append_token(self, token_id: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if not self.output_token_ids:
            self.first_token_time = now
        self.output_token_ids.append(token_id)

    def mark_running(self) -> None:
        """Admitted from the waiting queue; the first admission records the prompt tokens the prefix
        cache served (metrics) and, once, when queueing ended."""
        if self.num_preemptions == 0:
            self.num_cached_tokens = self.num_computed_tokens
        self.status = SequenceStatus.RUNNING
        if self.first_scheduled_time is None:
            self.first_scheduled_time = time.monotonic()

    def mark_finished(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finished_time = time.monotonic()

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        """The sequence's own RNG when params.seed is set (created on first use on `device`)."""
        if self.params.seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.params.seed)
        return self._generator
