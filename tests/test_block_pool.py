"""Block pool tests in the vLLM style: exact block ids, ref counts and eviction order."""

import pytest

from ferryman.engine.sequence import Sequence
from ferryman.kvcache.block_pool import BlockPool, chain_hashes, hash_block, ROOT_HASH

S = 4  # block size used throughout


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens)


def run_prefill(pool: BlockPool, seq: Sequence) -> None:
    """Admit `seq` with whatever prefix is cached, compute all its tokens, register full blocks."""
    prefix = pool.match_sequence(seq)
    assert pool.allocate_for(seq, seq.num_tokens - len(prefix) * S, prefix)
    seq.num_computed_tokens = seq.num_tokens
    pool.cache_full_blocks(seq)


def match(pool: BlockPool, tokens: list[int]) -> list[int]:
    return pool.match_sequence(make_seq(tokens))


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


def test_fresh_allocation_takes_lowest_ids_in_order():
    pool = BlockPool(8, S)
    a, b = make_seq(list(range(10))), make_seq(list(range(100, 105)))
    assert pool.allocate_for(a, 10)
    assert pool.allocate_for(b, 5)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    assert len(pool.free_queue) == 3 and pool.usage == pytest.approx(5 / 8)
    # Growing by one token inside the last block needs no new block; crossing a boundary does.
    a.num_computed_tokens = 10
    assert pool.num_new_blocks(a, 2) == 0 and pool.num_new_blocks(a, 3) == 1
    assert pool.allocate_for(a, 3) and a.block_table == [0, 1, 2, 5]


def test_allocation_fails_without_side_effects():
    pool = BlockPool(3, S)
    a = make_seq(list(range(13)))  # needs 4 blocks
    assert not pool.can_allocate(a, 13)
    assert not pool.allocate_for(a, 13)
    assert a.block_table == [] and len(pool.free_queue) == 3 and pool.queried_tokens == 0


def test_free_puts_tail_first_and_unhashed_blocks_at_the_front():
    pool = BlockPool(8, S)
    a = make_seq(list(range(10)))  # blocks 0, 1 full; block 2 partial
    run_prefill(pool, a)
    assert free_order(pool) == [3, 4, 5, 6, 7]
    assert [pool.blocks[b].block_hash is not None for b in a.block_table] == [True, True, False]
    pool.free(a)
    # Partial block 2 holds nothing reusable: first out. Cached ones LRU, prefix tail first.
    assert free_order(pool) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert a.block_table == [] and a.num_computed_tokens == 0


def test_prefix_hit_adopts_cached_blocks_and_skips_their_tokens():
    pool = BlockPool(8, S)
    a = make_seq(list(range(10)))
    run_prefill(pool, a)
    pool.free(a)
    b = make_seq(list(range(12)))  # same first 10 tokens, then 10, 11
    assert pool.match_sequence(b) == [0, 1]
    assert match(pool, list(range(12))) == [0, 1]
    assert pool.allocate_for(b, 4, [0, 1])
    assert b.block_table == [0, 1, 2]  # block 2 popped from the front of the queue
    assert b.num_computed_tokens == 8
    assert (pool.queried_tokens, pool.hit_tokens) == (10 + 12, 8)
    assert free_order(pool) == [3, 4, 5, 6, 7]


def test_match_never_covers_the_last_token():
    pool = BlockPool(8, S)
    run_prefill(pool, make_seq(list(range(8))))
    # All 8 tokens are cached, but the last one must be computed to get logits.
    assert match(pool, list(range(8))) == [0]
    assert match(pool, list(range(9))) == [0, 1]
    assert match(pool, [0]) == []


def test_hash_chain_depends_on_the_whole_prefix():
    pool = BlockPool(8, S)
    run_prefill(pool, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Block [5, 6, 7, 8] is cached, but only after [1, 2, 3, 4].
    assert match(pool, [0, 0, 0, 0, 5, 6, 7, 8, 9]) == []
    assert match(pool, [1, 2, 3, 4, 0, 6, 7, 8, 9]) == [0]
    h = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], S, 2)
    assert h == [hash_block(ROOT_HASH, [1, 2, 3, 4]), hash_block(h[0], [5, 6, 7, 8])]
    assert hash_block(ROOT_HASH, [5, 6, 7, 8]) != h[1]


def test_shared_blocks_are_ref_counted():
    pool = BlockPool(8, S)
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    run_prefill(pool, a)
    run_prefill(pool, b)  # adopts blocks 0, 1 (in use by a), gets its own tail
    assert a.block_table == [0, 1, 2] and b.block_table == [0, 1, 3]
    assert [pool.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    pool.free(a)
    assert free_order(pool) == [2, 4, 5, 6, 7]  # 0 and 1 are still held by b
    pool.free(b)
    assert free_order(pool) == [3, 2, 4, 5, 6, 7, 1, 0]


def test_cached_blocks_are_evicted_in_lru_order():
    pool = BlockPool(8, S)
    a = make_seq(list(range(10)))
    run_prefill(pool, a)
    pool.free(a)  # free queue: [2, 3, 4, 5, 6, 7, 1, 0]
    c = make_seq(list(range(100, 128)))  # 7 blocks, no shared content
    assert pool.allocate_for(c, 28)
    assert c.block_table == [2, 3, 4, 5, 6, 7, 1]  # block 1 evicted, block 0 survives
    assert pool.blocks[1].block_hash is None and len(pool.cached) == 1
    assert match(pool, list(range(10))) == [0]
    d = make_seq(list(range(200, 204)))
    assert pool.allocate_for(d, 4) and d.block_table == [0]
    assert match(pool, list(range(10))) == [] and pool.cached == {}


def test_adopting_free_cached_blocks_counts_against_free_space():
    pool = BlockPool(3, S)
    a = make_seq(list(range(8)))
    run_prefill(pool, a)
    pool.free(a)  # blocks 0, 1 cached and free; block 2 never used
    b = make_seq(list(range(12)))
    prefix = pool.match_sequence(b)
    assert prefix == [0, 1]
    assert pool.can_allocate(b, 4, prefix)  # 2 revived + 1 new == 3 free
    assert not pool.can_allocate(b, 8, prefix)  # 2 revived + 2 new > 3 free
    assert pool.allocate_for(b, 4, prefix) and b.block_table == [0, 1, 2]


def test_duplicate_content_is_cached_once():
    pool = BlockPool(8, S)
    a, b = make_seq(list(range(8))), make_seq(list(range(8)))
    # Both admitted before either computed anything: no hit, private blocks.
    assert pool.allocate_for(a, 8) and pool.allocate_for(b, 8)
    for seq in (a, b):
        seq.num_computed_tokens = 8
        pool.cache_full_blocks(seq)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    assert sorted(pool.cached.values()) == [0, 1]
    pool.free(b)
    assert free_order(pool) == [2, 3, 4, 5, 6, 7]  # unhashed duplicates go to the front
    assert match(pool, list(range(9))) == [0, 1]


def test_blocks_register_as_decoding_fills_them():
    pool = BlockPool(8, S)
    seq = make_seq([5, 6, 7])
    assert pool.allocate_for(seq, 3)
    seq.num_computed_tokens = 3
    pool.cache_full_blocks(seq)
    assert pool.cached == {}
    seq.append_token(8)
    assert pool.allocate_for(seq, 1)
    seq.num_computed_tokens = 4
    pool.cache_full_blocks(seq)
    assert list(pool.cached.values()) == [0]
    assert seq.block_hashes == chain_hashes([5, 6, 7, 8], S, 1)


def test_disabled_prefix_caching_never_hashes():
    pool = BlockPool(8, S, enable_prefix_caching=False)
    a = make_seq(list(range(10)))
    run_prefill(pool, a)
    pool.free(a)
    assert pool.cached == {} and match(pool, list(range(10))) == []
    assert free_order(pool) == [0, 1, 2, 3, 4, 5, 6, 7]


def test_prefix_blocks_only_at_admission():
    pool = BlockPool(8, S)
    run_prefill(pool, make_seq(list(range(5))))
    seq = make_seq(list(range(9)))
    assert pool.allocate_for(seq, 1)
    with pytest.raises(ValueError, match="admission"):
        pool.allocate_for(seq, 1, [0])


def test_reset_prefix_cache_drops_only_free_blocks():
    pool = BlockPool(8, S)
    a, b = make_seq(list(range(5))), make_seq(list(range(50, 55)))
    run_prefill(pool, a)
    run_prefill(pool, b)
    pool.free(a)
    assert pool.reset_prefix_cache() == 1
    assert list(pool.cached.values()) == [b.block_table[0]]
