"""The state pool of linear-attention layers (gated DeltaNet: Qwen3-Next, Qwen3.5), beside the paged KV.

Such a layer keeps no KV: each sequence carries a fixed-size state instead, its convolution's last
K-1 inputs and a [Hv, Dk, Dv] recurrent matrix per layer. The pool has one slot per sequence that
may run at once (max_num_seqs); the scheduler gives a sequence a slot with its first blocks and takes
it back with them (finish, preemption). The runner holds the tensors, `[slots, ...]` per layer
(models/transformer.py binds them to each GatedDeltaNet).

Invariants:
- a running sequence holds exactly one slot (seq.state_slot >= 0), a waiting one none (-1);
- the slot's state is that of the sequence's first num_computed_tokens tokens; a sequence starting
  at position 0 reads a zero state (the slot is never cleared: the layer zeroes what it reads).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ferryman.config import ModelConfig


class StateSequence(Protocol):
    seq_id: int
    state_slot: int  # -1: none


def num_linear_layers(cfg: ModelConfig) -> int:
    return sum(1 for i in range(cfg.num_layers) if cfg.is_linear_layer(i))


def conv_state_shape(cfg: ModelConfig) -> tuple[int, int]:
    """One layer's convolution state of a sequence: [C, K-1] (model dtype)."""
    la = cfg.linear_attn
    assert la is not None
    return la.conv_dim, la.conv_kernel - 1


def ssm_state_shape(cfg: ModelConfig) -> tuple[int, int, int]:
    """One layer's recurrent state of a sequence: [Hv, Dk, Dv] (fp32)."""
    la = cfg.linear_attn
    assert la is not None
    return la.num_v_heads, la.k_head_dim, la.v_head_dim


def state_bytes_per_seq(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one sequence's state over every linear-attention layer (0 for other models)."""
    n = num_linear_layers(cfg)
    if n == 0:
        return 0
    c, k = conv_state_shape(cfg)
    h, dk, dv = ssm_state_shape(cfg)
    return n * (c * k * dtype.itemsize + h * dk * dv * 4)


class StatePool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self, seq: StateSequence) -> bool:
        """Give `seq` a slot if it has none; False when the pool is empty."""
        if seq.state_slot >= 0:
            return True
        if not self.free_slots:
            return False
        seq.state_slot = self.free_slots.pop()
        return True

    def free(self, seq: StateSequence) -> None:
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1
