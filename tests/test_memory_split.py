"""KV pages and expert slots in one region, with the CPU as a fake device: pages move both ways, the
slots that move are the coldest, a moved slot's expert is refetched before use (byte-exact), a page
never has two owners, pinned slots never move; and the engine: sequences take slots back, and
preempted sequences resume with the tokens of an uninterrupted run."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from ferryman import LLM, SamplingParams
from ferryman.config import ModelConfig
from ferryman.engine.memory_split import EXPERT, KV, PINNED_PAGE, MemorySplit, SplitBounds
from ferryman.experts.gpu_cache import ExpertCache
from ferryman.experts.host_store import HostExpertStore
from ferryman.experts.policies import LRUPolicy
from ferryman.kvcache.block_pool import BlockPool
from ferryman.kvcache.shared_region import PageGeometry, SharedRegion
from ferryman.quant import get_format

BS = 4  # tokens per KV block


def _store() -> HostExpertStore:
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=32,
                      norm_topk_prob=True, router_kind="softmax_topk", router_bias=False, expert_act="silu",
                      expert_bias=False)
    store = HostExpertStore(cfg, torch.float32, pin=False)
    gen = torch.Generator().manual_seed(0)
    for layer in cfg.moe_layers:
        banks = get_format("dense").random_banks(8, 64, 32, False, torch.float32, gen)
        for name, t in banks.items():
            store.banks[layer][name].copy_(t)
    return store


def _setup(pages: int = 12, slots: int = 4, bounds: SplitBounds | None = None, min_kv: int = 2):
    """A region of `pages` pages (KV blocks of 1 KiB: a slot of 24 KiB is 24 of them), its first
    `slots` pages expert slots."""
    store = _store()
    geo = PageGeometry.of(1024, store.layout.row_bytes)
    region = SharedRegion(geo, pages, torch.device("cpu"))
    cache = ExpertCache(store, pages, torch.device("cpu"), LRUPolicy(), rows=region.slot_rows(),
                        active=range(slots))
    pool = BlockPool(region.num_blocks, BS, True, geo.blocks_per_page)
    split = MemorySplit(pool, lambda: cache, pages, bounds or SplitBounds(1, pages, 0), min_kv)
    return SimpleNamespace(store=store, geo=geo, region=region, cache=cache, pool=pool, split=split)


def _seq(seq_id: int, n: int) -> SimpleNamespace:
    seq = SimpleNamespace(seq_id=seq_id, block_table=[], window_table=[], block_hashes=[], num_computed_tokens=0,
                          num_tokens=n, token_ids_slice=lambda a, b: [seq_id * 1000 + i for i in range(a, b)])
    return seq


def _check_owners(t: SimpleNamespace) -> None:
    """Never two owners: an expert page is an active slot with its blocks withdrawn; a KV page is not
    active and each of its blocks is free or held."""
    table, pool = t.cache.table, t.pool
    for p in range(t.split.num_pages):
        blocks = [pool.blocks[b].ref_count for b in pool.page_blocks(p)]
        if t.split.owner[p] == EXPERT:
            assert table.active[p] and all(r == -1 for r in blocks), (p, blocks)
        else:
            assert t.split.owner[p] == KV and not table.active[p] and table.key_of[p] is None
            assert all(r >= 0 for r in blocks), (p, blocks)
    assert table.num_active == t.split.expert_pages
    assert sum(1 for b in pool.blocks if b.ref_count == -1) == pool.num_withdrawn
    assert set(table.slot_of.values()) <= {p for p in range(t.split.num_pages) if t.split.owner[p] == EXPERT}


def test_pages_move_both_ways() -> None:
    t = _setup(bounds=SplitBounds(1, 9, 0), min_kv=2)
    q = t.geo.blocks_per_page
    assert q == -(-t.store.layout.row_bytes // 1024) and t.split.expert_pages == 4
    _check_owners(t)
    assert t.split.rebalance() == 5  # idle KV pages become slots, up to max_slots (9)
    assert t.split.expert_pages == 9 and t.split.counters.to_experts == 5
    _check_owners(t)
    seq = _seq(1, 5 * q * BS)  # five pages of KV: two more than the three KV pages
    assert not t.pool.can_allocate(seq, seq.num_tokens) and t.pool.shortfall(seq, seq.num_tokens) == 2 * q
    assert t.split.ensure_kv(t.pool.shortfall(seq, seq.num_tokens) + len(t.pool.free_queue))
    assert t.pool.allocate_for(seq, seq.num_tokens)
    assert t.split.counters.to_kv == 2 and t.split.kv_pages == 5 and t.split.expert_pages == 7
    _check_owners(t)
    t.pool.free(seq)
    assert t.split.rebalance() > 0  # and back
    _check_owners(t)


def test_idle_pages_with_cached_prefixes_become_slots_last() -> None:
    t = _setup(pages=6, slots=2, bounds=SplitBounds(1, 3, 0), min_kv=1)
    q = t.geo.blocks_per_page
    seq = _seq(1, q * BS)  # fills one page (the first free blocks: page 2), then registers its prefix
    assert t.pool.allocate_for(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    t.pool.cache_full_blocks(seq)
    t.pool.free(seq)
    cached = [p for p in range(6) if t.split.owner[p] == KV and t.pool.cached_in_page(p)]
    assert len(cached) == 1 and t.pool.page_idle(cached[0])
    assert t.split.rebalance() == 1 and t.split.owner[cached[0]] == KV  # an uncached page went
    _check_owners(t)


def test_idle_floor_pages_serve_as_slots_and_come_back_on_demand() -> None:
    """The KV floor (one max_model_len sequence) is kept for admission, not held idle: with nothing
    held every KV page but the reserve's becomes a slot, and a sequence of the floor's length gets
    its pages back (down to min_slots, which never reaches into the floor)."""
    t = _setup(pages=10, slots=2, bounds=SplitBounds(2, 10, 0), min_kv=3)
    q = t.geo.blocks_per_page
    assert t.split.rebalance() == 8 and t.split.kv_pages == 0
    _check_owners(t)
    seq = _seq(1, 3 * q * BS)  # the floor's length
    assert t.split.ensure_kv(t.pool.shortfall(seq, seq.num_tokens))
    assert t.pool.allocate_for(seq, seq.num_tokens) and t.split.kv_pages == 3 and t.split.expert_pages == 7
    assert t.split.rebalance() == 0  # no page of a held sequence moves
    assert not t.split.ensure_kv(t.pool.num_blocks)  # min_slots stops it
    assert t.split.expert_pages == 2 and t.split.kv_pages == 8 and t.cache.table.active[PINNED_PAGE]
    _check_owners(t)
    t.pool.free(seq)


def test_kv_floor_reserve_and_bounds_are_kept() -> None:
    t = _setup(pages=10, slots=2, bounds=SplitBounds(2, 10, 0), min_kv=3)
    q = t.geo.blocks_per_page
    t.split.set_bounds(max_slots=2)
    assert t.split.rebalance() == 0 and t.split.kv_pages == 8  # max_slots
    assert not t.split.ensure_kv(t.pool.num_blocks)  # min_slots stops it
    assert t.split.expert_pages == 2 and t.cache.table.active[PINNED_PAGE]
    t.split.set_bounds(min_slots=1, max_slots=4, kv_reserve=7 * q)
    assert t.split.rebalance() == 1 and t.split.free_blocks == 7 * q  # the reserve stays free
    t.split.set_bounds(kv_reserve=0)
    t.split.rebalance()
    assert t.split.expert_pages == 4  # max_slots
    with pytest.raises(ValueError, match="max_expert_slots must be >= min_expert_slots"):
        t.split.set_bounds(min_slots=5, max_slots=4)
    with pytest.raises(ValueError, match=r"min_expert_slots must be in \[1, 7\]"):
        t.split.set_bounds(min_slots=8)
    t.split.set_bounds(max_slots=1)  # slots above a lower max go back now
    assert t.split.expert_pages == 1 and t.split.owner[PINNED_PAGE] == EXPERT
    _check_owners(t)


def test_the_slots_that_move_are_the_coldest_and_pinned_never() -> None:
    t = _setup(pages=12, slots=6)
    cache = t.cache
    for e in range(5):  # 5 of 6 slots hold layer 0's experts 0..4, used in that order; one is free
        cache.release(0, [e], cache.acquire(0, [e]))
    cache.release(0, [1], cache.acquire(0, [1]))  # 1 becomes the most recent
    held = cache.acquire(0, [0])  # 0 is in use (pinned)
    order = []
    for _ in range(4):
        before = dict(cache.table.slot_of)
        slot = cache.reclaim_slot(keep=lambda s: s == PINNED_PAGE)
        gone = [k for k in before if k not in cache.table.slot_of]
        order.append(gone[0] if gone else None)
        assert slot is not None and not cache.table.active[slot]
    # the free slot first, then LRU order (2, 3, 4), skipping pinned 0; 1 is the warmest
    assert order == [None, 2, 3, 4] and cache.table.slot_of.keys() == {0, 1}
    assert cache.table.slot_of[0] == held[0]
    cache.release(0, [0], held)


def test_a_moved_slot_is_refetched_before_use() -> None:
    t = _setup(pages=6, slots=3, bounds=SplitBounds(1, 6, 0), min_kv=1)
    cache, store = t.cache, t.store
    cache.release(0, [0], cache.acquire(0, [0]))  # slot 0 (never moved)
    slot = cache.acquire(1, [5])[0]
    cache.release(1, [5], [slot])
    assert slot == 1 and torch.equal(cache.pool.flat[slot], store.flat[1][5])
    cache.release(0, [0], cache.acquire(0, [0]))  # expert 5 is the coldest
    t.split.set_bounds(max_slots=1)  # slots 2 (free) and 1 (expert 5's) go back to KV
    assert not cache.contains(1, 5) and t.split.owner[slot] == KV and cache.contains(0, 0)
    t.region.buffer.view(-1)[slot * t.geo.page_bytes:(slot + 1) * t.geo.page_bytes].fill_(7)  # KV writes it
    t.split.set_bounds(max_slots=6)
    t.split.rebalance()
    misses = cache.counters.misses.get(1, 0)
    again = cache.acquire(1, [5])[0]
    assert cache.counters.misses[1] == misses + 1  # a miss: copied again
    assert torch.equal(cache.pool.flat[again], store.flat[1][5])
    cache.release(1, [5], [again])
    _check_owners(t)


def test_never_two_owners_under_random_load() -> None:
    rng = random.Random(3)
    t = _setup(pages=16, slots=3, bounds=SplitBounds(2, 14, 2), min_kv=2)
    seqs: dict[int, SimpleNamespace] = {}
    for step in range(300):
        op = rng.random()
        if op < 0.35:
            seq = _seq(step, rng.randint(1, 40))
            short = t.pool.shortfall(seq, seq.num_tokens)
            if short:
                t.split.ensure_kv(len(t.pool.free_queue) + short)
            if t.pool.allocate_for(seq, seq.num_tokens):
                seqs[step] = seq
        elif op < 0.6 and seqs:
            seq = seqs.pop(rng.choice(list(seqs)))
            seq.num_computed_tokens = seq.num_tokens
            t.pool.cache_full_blocks(seq)
            t.pool.free(seq)
        elif op < 0.85:
            layer, experts = rng.randint(0, 1), rng.sample(range(8), 2)
            if t.cache.available() >= 2:
                slots = t.cache.acquire(layer, experts)
                for e, s in zip(experts, slots):
                    assert torch.equal(t.cache.pool.flat[s], t.store.flat[layer][e])
                t.cache.release(layer, experts, slots)
        else:
            t.split.rebalance()
        _check_owners(t)
    assert t.split.counters.to_kv > 0 and t.split.counters.to_experts > 0


PROMPTS = [[5, 17, 42, 7, 99] * 3, list(range(20, 40)), [(i * 37) % 250 + 3 for i in range(29)], [3, 4] * 6]
KW = dict(device="cpu", dtype="float32", max_num_batched_tokens=32, enforce_eager=True, max_model_len=96)


def _greedy(llm: LLM, n: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, params=params)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _greedy(LLM(**KW))


def test_sequences_take_slots_back_and_tokens_match(reference: list[list[int]]) -> None:
    """A KV floor of one sequence: four sequences take expert slots as they grow, give them back when
    done, and the greedy tokens are the resident engine's."""
    llm = LLM(moe_strategy="offload", expert_cache=40, kv_cache_tokens=96, min_expert_slots=4, **KW)
    start = llm.memory_split()
    assert LLM(moe_strategy="offload", expert_cache=80, **KW).memory_split()["min_expert_slots"] == 64  # 2 x 32
    assert start["shared"] and start["expert_pages"] == 40
    assert _greedy(llm) == reference
    split = llm.memory_split()
    assert split["moves_to_kv"] > 0 and split["moves_to_experts"] > 0
    assert split["num_preemptions"] == 0 and split["expert_pages"] == 40  # back to the cap once idle


def test_preempted_sequences_resume_with_the_same_tokens(reference: list[list[int]]) -> None:
    """No slot may go (min_expert_slots = the cache): KV runs short, sequences are preempted and
    recomputed, and the greedy tokens are those of an uninterrupted run."""
    llm = LLM(moe_strategy="offload", expert_cache=40, kv_cache_tokens=96, min_expert_slots=40, **KW)
    assert _greedy(llm) == reference
    split = llm.memory_split()
    assert split["num_preemptions"] > 0 and split["moves_to_kv"] == 0


def test_a_lone_short_sequence_leaves_the_kv_floor_to_the_experts() -> None:
    """A budget whose KV floor is one 512-token sequence: a 23-token request leaves the floor's idle
    pages as expert slots; a 500-token prompt then takes them back (no preemption) as a layer-major
    job (its admission asks for the pages, as a chunk's does) and its greedy tokens are the resident
    engine's."""
    kw = dict(KW, max_model_len=512, max_num_seqs=4)
    llm = LLM(moe_strategy="offload", gpu_memory="215MiB", min_expert_slots=4, **kw)
    start = llm.memory_split()
    assert start["kv_pages"] == start["min_kv_pages"] == 11  # 528 tokens in pages of 3 blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(prompt_token_ids=[PROMPTS[0]], params=params)
    lone = llm.memory_split()
    assert lone["kv_pages"] < 3 and lone["expert_pages"] > start["expert_pages"] + 8
    long = [(i * 37) % 250 + 3 for i in range(500)]
    got = llm.generate(prompt_token_ids=[long], params=params)[0].token_ids
    split = llm.memory_split()
    assert split["moves_to_kv"] >= 10 and split["num_preemptions"] == 0
    assert llm.engine.prefill_jobs["jobs"] == 1  # not chunk-major for want of free blocks
    assert got == LLM(**kw).generate(prompt_token_ids=[long], params=params)[0].token_ids


def test_live_bounds_through_the_public_api() -> None:
    from ferryman.errors import ConfigError

    llm = LLM(moe_strategy="offload", expert_cache=40, kv_cache_tokens=96, min_expert_slots=4, **KW)
    out = llm.set_memory_bounds(max_expert_slots=30)
    assert out["expert_pages"] == 30 and out["max_expert_slots"] == 30
    with pytest.raises(ConfigError, match="max_expert_slots must be >= min_expert_slots"):
        llm.set_memory_bounds(min_expert_slots=31)
    assert LLM(**KW).memory_split()["shared"] is False
    with pytest.raises(ConfigError, match="need offloaded experts"):
        LLM(**KW).set_memory_bounds(min_expert_slots=2)


def test_gpt_oss_20b_at_8gib_with_32_sequences_of_8192_plans() -> None:
    """The configuration that reserved 6.27 GiB of KV for 262,144 tokens now plans: one sequence of
    8192 tokens is the KV floor, the experts take the rest of the budget."""
    from ferryman.cli import main
    from ferryman.models.registry import model_config
    from ferryman.planner import PlanRequest
    from ferryman.planner_search import plan_memory
    from ferryman.weights.presets import get_preset

    cfg = model_config(get_preset("gpt-oss-20b"))
    plan = plan_memory(PlanRequest(cfg, torch.bfloat16, 8 << 30, 8192, 32))
    assert plan.strategy == "offload" and plan.shared and plan.total_bytes <= 8 << 30
    assert 8192 <= plan.kv_tokens < 8192 + plan.pages.blocks_per_page * 16
    assert plan.expert_slots > 0.4 * plan.request.total_experts
    assert main(["plan", "gpt-oss-20b", "--gpu-memory", "8GiB", "--max-num-seqs", "32",
                 "--max-model-len", "8192"]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False])
def test_split_on_cuda_gives_the_resident_tokens(eager: bool) -> None:
    """On CUDA (stream copies into strided slot rows, paged attention over strided KV views, per-layer
    graphs unless eager): sequences take slots back and return them, tokens are the resident ones."""
    kw = dict(KW, device="cuda", enforce_eager=eager)
    want = _greedy(LLM(**kw))
    llm = LLM(moe_strategy="offload", expert_cache=40, kv_cache_tokens=96, min_expert_slots=4, **kw)
    assert _greedy(llm) == want
    split = llm.memory_split()
    assert split["moves_to_kv"] > 0 and split["moves_to_experts"] > 0 and split["num_preemptions"] == 0
