"""What paged attention reads of a step besides q and the caches: `AttnMetadata`.

Shapes: T = tokens in the step, B = sequences. Kv position p of sequence b lives at block
`block_tables[b, p // S]`, offset `p % S` of the cache `[N, S, Hkv, D]`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor


@dataclass
class StateMetadata:
    """What the linear-attention layers read of a step (kvcache/state_pool.py): each sequence's slot
    in the state pool, whether it starts from a zero state, and where inside its chunk its state is
    saved to a prefix-cache checkpoint (kvcache/state_checkpoints.py)."""

    slots: Tensor  # [B] int64, state-pool slot of each sequence
    fresh: Tensor  # [B] bool, True where the sequence starts at position 0 (its state is zero)
    host_starts: list[int]  # [B+1] query_start_loc on the host (the torch path walks sequences)
    host_slots: list[int]  # [B] slots on the host
    host_fresh: list[bool]  # [B] fresh on the host
    # [B] per sequence, ascending (offset into its chunk, checkpoint): the state after its first
    # `offset` tokens goes to that checkpoint (0 < offset < its tokens); None: no such saves this step
    host_saves: list[list[tuple[int, int]]] | None = None


@dataclass
class AttnMetadata:
    query_start_loc: Tensor  # [B+1] int32, cumulative query lengths (decode: 0..B)
    seq_lens: Tensor  # [B] int32, kv length after this step (cached + new)
    block_tables: Tensor  # [B, max_blocks] int32, -1/0 padded
    slot_mapping: Tensor  # [T] int64, block * S + offset where each new token's k/v goes (-1 = skip)
    max_query_len: int
    max_seq_len: int
    # sliding-window layers with a pool of their own (kvcache/window_pool.py): their tables
    # [B, max_blocks] (NULL_BLOCK before the window, same width as block_tables) and slots [T]
    window_block_tables: Tensor | None = None
    window_slot_mapping: Tensor | None = None
    state: StateMetadata | None = None  # hybrid models: the linear-attention layers' state slots

    def windowed(self) -> AttnMetadata:
        """The metadata a sliding-window layer reads: its own pool's tables and slots, if it has a pool."""
        if self.window_block_tables is None or self.window_slot_mapping is None:
            return self
        return replace(self, block_tables=self.window_block_tables, slot_mapping=self.window_slot_mapping,
                       window_block_tables=None, window_slot_mapping=None)
