"""The KV pool of the sliding-window layers (gpt-oss: every other layer sees only the last 128 tokens).

A query at position q of a layer with window W reads kv positions q - W + 1 .. q only, so once a
sequence has computed c tokens, its blocks wholly before position c - W + 1 are never read again:
`release_stale` hands them back. Those layers then need a small pool of fixed size
(`window_pool_blocks`) instead of the context-sized main pool (block_pool.py); the planner gives
what that frees to expert slots.

Tables: `seq.window_table` has one entry per logical block, like `seq.block_table`; entries before
the window are NULL_BLOCK, which is never handed out and never written (its K/V stay zero), so the
kernels index both tables alike: the Triton kernel starts at the window, and the torch reference
masks the zeros it gathers.

Invariants:
- after `release_stale(seq)`, seq holds no block wholly before `first_needed(seq.num_computed_tokens)`;
  the scheduler calls it after every step and before every allocation, so between steps a sequence
  holds at most cdiv(W, S) + 1 blocks here;
- a released block keeps its prefix-cache hash and joins the back of the free queue (LRU, as in
  block_pool.py): an agent's next turn can adopt the last window of its conversation;
- a prefix hit of the main pool is taken only as far as this pool still holds the window before
  its end (`usable_prefix`); tokens past it are recomputed.
`LLM.score` computes its prompts in one step, so it scores at most this pool's tokens per call.
"""

from __future__ import annotations

from ferryman.config import ModelConfig
from ferryman.kvcache.block_pool import BlockPool, Sequence, cdiv

NULL_BLOCK = 0  # the entry of out-of-window blocks: never free, never written


def window_split(cfg: ModelConfig) -> int | None:
    """The window W when the model mixes layers of one sliding window W with full-attention
    layers; None: one pool holds every layer's KV."""
    windows = [cfg.window_of(i) for i in range(cfg.num_layers)]
    sizes = {w for w in windows if w is not None}
    if len(sizes) != 1 or None not in windows:
        return None
    return sizes.pop()


def num_window_layers(cfg: ModelConfig) -> int:
    """Layers whose KV lives in the window pool (0 without a split)."""
    if window_split(cfg) is None:
        return 0
    return sum(cfg.window_of(i) is not None for i in range(cfg.num_layers))


def window_pool_need(window: int, block_size: int, max_num_seqs: int, step_tokens: int) -> int:
    """Blocks that let every step allocate: between steps each running sequence holds at most
    cdiv(W, S) + 1 blocks, a step adds at most cdiv(n, S) per scheduled sequence (n its tokens,
    summing to at most step_tokens, so at most cdiv(sum, S) + 1 each), plus NULL_BLOCK."""
    return 1 + max_num_seqs * (cdiv(window, block_size) + 2) + cdiv(step_tokens, block_size)


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, step_tokens: int) -> int:
    """The planned size: `window_pool_need`, and one more window per sequence, which keeps finished
    conversations' last windows for the prefix cache a while."""
    retain = max_num_seqs * (cdiv(window, block_size) + 1)
    return window_pool_need(window, block_size, max_num_seqs, step_tokens) + retain


def ring_table(table: list[int], window: int, block_size: int, first: int, ring: int, start: int,
               end: int) -> list[int]:
    """The window table a layer-major job (engine/prefill_job.py) uses for positions [start, end):
    logical blocks from `first` on map onto the `ring` blocks `table` holds there, block b to ring
    slot (b - first) % ring; blocks before the window of `start` are NULL_BLOCK.

    Invariant: ring >= the blocks a chunk reads or writes (its window and its own), so within one
    layer a chunk never overwrites what a later query of that layer reads."""
    lo = max(0, start - window + 1) // block_size  # WindowBlockPool.first_needed
    blocks = [table[b] if b < first else table[first + (b - first) % ring] for b in range(cdiv(end, block_size))]
    return [NULL_BLOCK] * min(lo, len(blocks)) + blocks[lo:]


class WindowBlockPool(BlockPool):
    """The window layers' blocks: a BlockPool whose tables drop what fell out of the window."""

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool = True) -> None:
        if window < 1:
            raise ValueError(f"sliding window must be >= 1 token, got {window}")
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.window = window
        del self.free_queue[NULL_BLOCK]
        self.blocks[NULL_BLOCK].ref_count = 1  # held by nobody, handed out never
        self._released: dict[int, int] = {}  # seq_id -> table entries [0, n) already NULL_BLOCK

    def table(self, seq: Sequence) -> list[int]:
        return seq.window_table

    def first_needed(self, computed: int) -> int:
        """The first logical block a query at position >= `computed` can see."""
        return max(0, computed - self.window + 1) // self.block_size

    def release_stale(self, seq: Sequence) -> None:
        """Hand back the blocks of `seq` no future query of it can see."""
        table = seq.window_table
        start = self._released.get(seq.seq_id, 0)
        end = min(self.first_needed(seq.num_computed_tokens), len(table))
        for i in range(start, end):
            self._release(table[i])
            table[i] = NULL_BLOCK
        if end > start:
            self._released[seq.seq_id] = end

    def usable_prefix(self, seq: Sequence, num_hit: int) -> list[int]:
        """Of a main-pool hit of `num_hit` blocks (from `match_sequence`, so seq.block_hashes covers
        them): the window table of the longest k <= num_hit blocks whose window this pool still holds,
        NULL_BLOCK up to first_needed(k * S) then the cached blocks; len() of it is k."""
        if not self.enable_prefix_caching:
            return []
        for k in range(num_hit, 0, -1):
            lo = self.first_needed(k * self.block_size)
            ids = self._lookup(seq.block_hashes[lo:k])
            if len(ids) == k - lo:
                return [NULL_BLOCK] * lo + ids
        return []

    def _admit(self, seq: Sequence, prefix_blocks: list[int]) -> None:
        """Adopt a `usable_prefix` hit; the main pool admitted `seq` first and set its computed tokens."""
        lo = prefix_blocks.count(NULL_BLOCK)
        for block_id in prefix_blocks[lo:]:
            self._take(block_id)
        seq.window_table.extend(prefix_blocks)
        self._num_registered[seq.seq_id] = len(prefix_blocks)
        self._released[seq.seq_id] = lo

    def fold_ring(self, seq: Sequence, first: int, ring: int, end: int) -> None:
        """A layer-major job computed positions up to `end` through the ring: the table becomes what
        `release_stale` leaves after a chunk-major prefill of them (the last window, NULL before it),
        and ring blocks outside it go back to the pool. Call before `cache_full_blocks`."""
        final = ring_table(seq.window_table, self.window, self.block_size, first, ring, end, end)
        keep = set(final)
        for block_id in set(seq.window_table[self._released.get(seq.seq_id, 0):]) - keep:
            self._release(block_id)
        seq.window_table[:] = final
        self._released[seq.seq_id] = final.count(NULL_BLOCK)

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self._released.pop(seq.seq_id, None)

    def _release(self, block_id: int) -> None:
        if block_id != NULL_BLOCK:
            super()._release(block_id)

    def _register(self, block_id: int, block_hash: bytes) -> None:
        if block_id != NULL_BLOCK:
            super()._register(block_id, block_hash)
