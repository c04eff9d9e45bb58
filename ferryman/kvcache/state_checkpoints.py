"""Prefix caching for hybrid models: checkpoints of the linear-attention state at block boundaries.

A cached KV prefix alone cannot resume a hybrid model: its linear-attention layers need their state
after exactly that prefix. So the state of a sequence is saved where a later request is likely to
branch off (`checkpoint_positions`): the block boundary at or below the end of its prompt, and
those at or below the ends of its last chat messages (`SamplingParams.message_ends`, which the
server's chat rendering sets). An agent's next turn re-sends that prompt, the answer and a new
message; a turn that branches (an edited or retried last message, a new conversation under the same
system prompt) shares only the messages before the branch. Either adopts the cached blocks up to the
nearest checkpoint, restores the state into its slot and prefills only the tail.

The scheduler keeps the index (`CheckpointIndex`: prefix hash -> checkpoint slot, LRU) and puts the
copies in `SchedulerOutput`: restores before the forward, saves of a chunk's end state after it, and
saves at positions inside a chunk (a chunk never stops early for a checkpoint), which the
linear-attention layers write during the forward (layers/gated_deltanet.py). The runner keeps the
tensors (`CheckpointStore`, host RAM: `[checkpoints, ...]` per layer, pinned on CUDA, counted by
the planner as host memory) and binds each layer's pair to it.

Invariants:
- a hybrid sequence adopts a cached prefix of L blocks only if a checkpoint of hash L - 1 exists;
- a checkpoint slot holds the state after the prefix whose hash keys it; restores of a step run
  before its saves (those inside chunks included), so a slot reassigned in the step is read before
  it is overwritten.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

MESSAGE_CHECKPOINTS = 2  # message ends checkpointed per prompt: the last ones (besides the prompt's end)
CHECKPOINTS_PER_SEQ = 2 * (1 + MESSAGE_CHECKPOINTS)  # checkpoint slots per sequence slot: this turn's and the last


def checkpoint_position(num_prompt_tokens: int, block_size: int) -> int:
    """The block boundary at or below the prompt's last token (0: the prompt is within one block)."""
    return (num_prompt_tokens - 1) // block_size * block_size


def checkpoint_positions(num_prompt_tokens: int, block_size: int, message_ends: list[int]) -> list[int]:
    """Ascending block boundaries to save the state at: the prompt's (`checkpoint_position`) and those
    at or below its last MESSAGE_CHECKPOINTS message ends (token offsets into the prompt); a boundary
    is > 0 and leaves at least the prompt's last token to compute."""
    last = checkpoint_position(num_prompt_tokens, block_size)
    ends = sorted(set(message_ends))[-MESSAGE_CHECKPOINTS:]
    found = {min(end, last) // block_size * block_size for end in ends} | {last}
    return sorted(p for p in found if p > 0)


class CheckpointIndex:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> slot, least recent first
        self.free: list[int] = list(range(num_slots - 1, -1, -1))

    def find(self, prefix_hash: bytes) -> int | None:
        return self.slots.get(prefix_hash)

    def use(self, prefix_hash: bytes) -> int:
        """The slot of a checkpoint about to be restored (now the most recently used)."""
        self.slots.move_to_end(prefix_hash)
        return self.slots[prefix_hash]

    def reserve(self, prefix_hash: bytes) -> int:
        """A slot for a new checkpoint: a free one, else the least recently used one's."""
        if self.free:
            slot = self.free.pop()
        else:
            _, slot = self.slots.popitem(last=False)
        self.slots[prefix_hash] = slot
        return slot

    def clear(self) -> None:
        self.free.extend(self.slots.values())
        self.slots.clear()


class CheckpointStore:
    """The checkpoints' tensors, one (conv, recurrent) pair of `[checkpoints, ...]` per layer.
    `states`: the layers' (conv_state, ssm_state) pools it copies from and to."""

    def __init__(self, num_slots: int, states: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        pin = any(t.is_cuda for pair in states for t in pair)
        self.states = states
        self.saved = [tuple(torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in pair)
                      for pair in states]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.saved for t in pair)

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """(checkpoint, state slot) pairs: checkpoint -> slot."""
        for (live_conv, live_ssm), (conv, ssm) in zip(self.states, self.saved):
            for ckpt, slot in pairs:
                live_conv[slot].copy_(conv[ckpt], non_blocking=True)
                live_ssm[slot].copy_(ssm[ckpt], non_blocking=True)

    def save(self, pairs: list[tuple[int, int]]) -> None:
        """(state slot, checkpoint) pairs: slot -> checkpoint."""
        for (live_conv, live_ssm), (conv, ssm) in zip(self.states, self.saved):
            for slot, ckpt in pairs:
                conv[ckpt].copy_(live_conv[slot], non_blocking=True)
                ssm[ckpt].copy_(live_ssm[slot], non_blocking=True)
