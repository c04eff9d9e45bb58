"""What the sampler and the engine return: sampled tokens, logprobs, request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

TokenLogprobs = tuple[float, list[tuple[int, float]]]  # (chosen token's logprob, top-n (id, logprob))


@dataclass
class SamplerOutput:
    """What one step sampled, for the sequences that sampled."""

    token_ids: dict[int, int] = field(default_factory=dict)  # seq_id -> sampled token
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # seq_id -> its logprobs, when asked


@dataclass
class RequestMetrics:
    ttft_s: float | None = None  # arrival -> first output token
    queue_s: float | None = None  # arrival -> first scheduled (waiting for a place in a step)
    decode_tokens_per_s: float | None = None  # output tokens after the first / time after the first
    total_s: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepDelta:
    """New output of one request in one engine step (for streaming)."""

    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per token id; None: not asked
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (set from the first delta on)
