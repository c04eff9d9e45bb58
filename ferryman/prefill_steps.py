"""How a step cuts prompts into pieces: a chunk of `max_num_batched_tokens`, and a short tail taken
with the last piece.

A prompt's last piece may run past the step's chunk by chunk // PREFILL_TAIL_DIV tokens, so a prompt a
few tokens longer than a chunk takes one step, not a second one for its tail (the second step's fixed
costs, per layer, came to 50-85 ms for the 74 tokens past 4,096 of a gpt-oss-20b prompt on the H200
machine: docs/benchmarks.md). The scheduler's chunk-major pieces and a layer-major job's chunks both
cut by `piece_tokens`, so both modes see the same chunks; whatever counts a step's memory counts
`step_tokens`.
"""

from __future__ import annotations

PREFILL_TAIL_DIV = 32


def prefill_tail(chunk: int) -> int:
    """Tokens a prompt's last piece may take beyond a chunk of `chunk` tokens."""
    return chunk // PREFILL_TAIL_DIV


def step_tokens(chunk: int) -> int:
    """The most tokens one step computes with chunks of `chunk` tokens: what the memory plan counts."""
    return chunk + prefill_tail(chunk)


def piece_tokens(remaining: int, budget: int, chunk: int) -> int:
    """Tokens of a prompt with `remaining` to compute that a step takes when `budget` tokens of its
    chunk are left: all of them if they fit in the budget and the tail, else at most the budget."""
    if budget <= 0:
        return 0
    return remaining if remaining <= budget + prefill_tail(chunk) else budget


def pieces_of(tokens: int, chunk: int) -> tuple[int, int]:
    """(full chunks, the last piece's tokens or 0) of one prompt of `tokens` with its steps to itself:
    what cutting by `piece_tokens` gives."""
    full, rest = divmod(tokens, chunk)
    return (full - 1, chunk + rest) if full and rest and rest <= prefill_tail(chunk) else (full, rest)
