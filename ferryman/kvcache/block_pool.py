"""KV cache block pool: ref-counted blocks, an LRU free queue and hash-chained prefix caching.

A block holds the KV of `block_size` consecutive tokens of a sequence. Blocks whose tokens are all
computed are *full*; with prefix caching a full block is registered under the hash of its tokens
chained with the hash of everything before it, so a later sequence with the same prefix can adopt
it instead of recomputing. A freed block keeps its hash and stays adoptable until the free queue
hands it out again (eviction).

Free queue order (front = next handed out):
  - a sequence's blocks are freed last block first, so a shared prefix outlives its private tail;
  - freed blocks without a hash (partial tails, duplicates) go to the front: they hold nothing
    reusable; freed cached blocks go to the back (least recently used is evicted first).

Pages (kvcache/shared_region.py): blocks b with b // blocks_per_page == p form page p. A whole page
of free blocks can be *withdrawn* (lent to the expert cache: out of the free queue, hashes
dropped) and later *restored*. Invariant: a block is withdrawn, or held, or in the free queue;
held_in_page[p] counts the held blocks of page p.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Protocol

BlockHash = bytes


class Sequence(Protocol):
    """What the pools read and write of a sequence (engine/sequence.py's Sequence)."""

    seq_id: int
    block_table: list[int]  # logical block -> block id of the main pool
    window_table: list[int]  # the same of the window pool (window_pool.py)
    block_hashes: list[BlockHash]  # hashes of its full blocks, filled as they are needed
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    def token_ids_slice(self, start: int, stop: int) -> list[int]: ...

# Parent hash of a sequence's first block.
ROOT_HASH: BlockHash = b"ferryman-kv-root"


def hash_block(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    """Hash of one full block chained to its parent's hash (128-bit BLAKE2b: no practical
    collisions, so a hit never needs the tokens re-checked)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_hashes(token_ids: list[int], block_size: int, num_blocks: int,
                 parent: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """Hashes of the first `num_blocks` full blocks of `token_ids`."""
    hashes = []
    for i in range(num_blocks):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0  # sequences whose block_table holds this block
        self.block_hash: BlockHash | None = None  # set while registered in the prefix cache

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 blocks_per_page: int = 1) -> None:
        self.num_blocks = num_blocks
        self.blocks_per_page = blocks_per_page
        self.held_in_page = [0] * -(-num_blocks // blocks_per_page)
        self.num_withdrawn = 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Invariant: a block is in free_queue iff its ref_count is 0.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Invariant: cached[h] == b iff blocks[b].block_hash == h.
        self.cached: dict[BlockHash, int] = {}
        # seq_id -> number of leading blocks of its block_table already registered (or skipped).
        self._num_registered: dict[int, int] = {}
        self.queried_tokens = 0  # prompt tokens looked up at admission
        self.hit_tokens = 0  # of those, served by the prefix cache

    # ---- stats -------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of the usable (not withdrawn) blocks held by sequences."""
        usable = self.num_blocks - self.num_withdrawn
        return 1.0 - len(self.free_queue) / usable if usable else 1.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    # ---- prefix lookup -----------------------------------------------------------------------

    def match_sequence(self, seq: Sequence) -> list[int]:
        """Ids of cached blocks holding the longest cached prefix of `seq`'s tokens (hashes are kept
        on the sequence). Never covers the last token: it must be computed so the step yields logits."""
        if not self.enable_prefix_caching:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, num_full)
        return self._lookup(seq.block_hashes[:num_full])

    def _lookup(self, hashes: list[BlockHash]) -> list[int]:
        hit = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def _extend_hashes(self, seq: Sequence, num_full: int) -> None:
        done = len(seq.block_hashes)
        if num_full <= done:
            return
        S = self.block_size
        tokens = seq.token_ids_slice(done * S, num_full * S)
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
        seq.block_hashes.extend(chain_hashes(tokens, S, num_full - done, parent))

    # ---- allocation --------------------------------------------------------------------------

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int,
                       prefix_blocks: list[int] | None = None) -> int:
        """Blocks to take from the free queue so `seq` can hold `num_new_tokens` more tokens
        (at admission, an empty table, after adopting `prefix_blocks`, if given)."""
        table = self.table(seq)
        have = len(table) if table else len(prefix_blocks or ())
        computed = seq.num_computed_tokens if table else have * self.block_size
        return max(0, cdiv(computed + num_new_tokens, self.block_size) - have)

    def can_allocate(self, seq: Sequence, num_new_tokens: int,
                     prefix_blocks: list[int] | None = None) -> bool:
        # Adopting a cached block nobody holds takes it out of the free queue as well.
        revived = sum(1 for b in prefix_blocks or () if self.blocks[b].ref_count == 0)
        return self.num_new_blocks(seq, num_new_tokens, prefix_blocks) + revived <= len(self.free_queue)

    def allocate_for(self, seq: Sequence, num_new_tokens: int,
                     prefix_blocks: list[int] | None = None) -> bool:
        """Grow `seq.block_table` to hold `num_new_tokens` more tokens; False (and nothing
        changed) when the pool is short of blocks.

        `prefix_blocks` (from `match_sequence`) is only allowed on a sequence holding no blocks:
        it adopts them and its num_computed_tokens becomes the number of tokens they hold.
        """
        if not self.can_allocate(seq, num_new_tokens, prefix_blocks):
            return False
        self.grow(seq, num_new_tokens, prefix_blocks)
        return True

    def grow(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] | None = None) -> None:
        """`allocate_for` once `can_allocate` said yes (the scheduler asks every pool first)."""
        table = self.table(seq)
        if prefix_blocks and table:
            raise ValueError(f"seq {seq.seq_id} already holds blocks; "
                             "prefix blocks are adopted only at admission")
        if not table:
            self._admit(seq, prefix_blocks or [])
        for _ in range(self.num_new_blocks(seq, num_new_tokens)):
            table.append(self._pop_free())

    def table(self, seq: Sequence) -> list[int]:
        """The block table this pool fills on `seq` (logical block i -> block id)."""
        return seq.block_table

    def _admit(self, seq: Sequence, prefix_blocks: list[int]) -> None:
        if seq.num_computed_tokens:
            raise ValueError(f"seq {seq.seq_id} has computed tokens but holds no blocks")
        for block_id in prefix_blocks:
            self._take(block_id)
        self.table(seq).extend(prefix_blocks)
        seq.num_computed_tokens = len(prefix_blocks) * self.block_size
        self._num_registered[seq.seq_id] = len(prefix_blocks)
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += seq.num_computed_tokens

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
            self.held_in_page[block_id // self.blocks_per_page] += 1
        block.ref_count += 1

    def _pop_free(self) -> int:
        """Hand out the front of the free queue, evicting its cached content if any."""
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        self.held_in_page[block_id // self.blocks_per_page] += 1
        return block_id

    # ---- caching and freeing -----------------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that became full of computed tokens since the last call."""
        if not self.enable_prefix_caching:
            return
        start = self._num_registered.get(seq.seq_id, 0)
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= start:
            return
        self._extend_hashes(seq, num_full)
        table = self.table(seq)
        for i in range(start, num_full):
            self._register(table[i], seq.block_hashes[i])
        self._num_registered[seq.seq_id] = num_full

    def _register(self, block_id: int, block_hash: BlockHash) -> None:
        block = self.blocks[block_id]
        # Identical content already cached in another block: keep that one, this block
        # stays private and unhashed (it is evicted first once freed).
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block_id

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (finished or preempted); its KV is no longer computed."""
        table = self.table(seq)
        for block_id in reversed(table):
            self._release(block_id)
        table.clear()
        seq.num_computed_tokens = 0
        self._num_registered.pop(seq.seq_id, None)

    def _release(self, block_id: int) -> None:
        """Drop one reference; at zero the block joins the free queue (see the module's order)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.held_in_page[block_id // self.blocks_per_page] -= 1
            self.free_queue[block_id] = None
            if block.block_hash is None:
                self.free_queue.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> int:
        """Forget the hashes of all blocks no sequence holds; returns how many were dropped."""
        dropped = 0
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                dropped += 1
        return dropped

    # ---- pages lent to the expert cache ------------------------------------------------------

    def page_blocks(self, page: int) -> range:
        q = self.blocks_per_page
        return range(page * q, min(self.num_blocks, (page + 1) * q))

    def page_idle(self, page: int) -> bool:
        """No sequence holds a block of `page` and none is withdrawn (a cached prefix may live there)."""
        blocks = self.page_blocks(page)
        return self.held_in_page[page] == 0 and all(b in self.free_queue for b in blocks)

    def cached_in_page(self, page: int) -> int:
        """Blocks of `page` registered in the prefix cache."""
        return sum(1 for b in self.page_blocks(page) if self.blocks[b].block_hash is not None)

    def withdraw_page(self, page: int) -> None:
        """Take an idle page's blocks out of use (their cached prefixes are forgotten)."""
        if not self.page_idle(page):
            raise ValueError(f"KV page {page} is not idle: a sequence holds one of its blocks, or it is lent")
        for b in self.page_blocks(page):
            del self.free_queue[b]
            block = self.blocks[b]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_count = -1  # withdrawn: never in a table, never freed
        self.num_withdrawn += len(self.page_blocks(page))

    def restore_page(self, page: int) -> None:
        """Give a withdrawn page's blocks back to the free queue (front: they hold nothing)."""
        for b in self.page_blocks(page):
            if self.blocks[b].ref_count != -1:
                raise ValueError(f"KV block {b} of page {page} was not withdrawn")
            self.blocks[b].ref_count = 0
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)
        self.num_withdrawn -= len(self.page_blocks(page))

    def shortfall(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] | None = None) -> int:
        """Free blocks missing for `can_allocate` to say yes (0 when it does)."""
        revived = sum(1 for b in prefix_blocks or () if self.blocks[b].ref_count == 0)
        return max(0, self.num_new_blocks(seq, num_new_tokens, prefix_blocks) + revived - len(self.free_queue))
