"""Expert cache bookkeeping with the CPU as a fake device: exact slots and evictions, pins, prefetch
admission, host-store layout, byte-exact copies, dedupe across a batch, rounds, and the order of
transfer calls (fetch -> wait -> kernel -> mark_used)."""

from __future__ import annotations

import logging

import pytest
import torch

from ferryman.config import ModelConfig, QuantConfig
from ferryman.experts.gpu_cache import ExpertCache, coalesce
from ferryman.experts.slot_table import SlotTable
from ferryman.experts.host_store import HostExpertStore
from ferryman.quant.layout import ALIGN
from ferryman.experts.offload import OffloadExperts
from ferryman.experts.policies import LRUPolicy, make_policy
from ferryman.experts.guesses import NextLayerGuesser
from tools.demo_model.trace import lru_hit_rate
from ferryman.experts.transfer import Copy, SyncTransfer
from ferryman.layers.fused_moe import MoEActivation, fused_moe
from ferryman.quant import get_format


def _cfg(fmt: str = "dense", experts: int = 8, layers: int = 3, bias: bool = False) -> ModelConfig:
    return ModelConfig(
        model_type="qwen3_moe", vocab_size=64, hidden_size=64, num_layers=layers, num_heads=4, num_kv_heads=2,
        head_dim=16, num_experts=experts, top_k=2, moe_intermediate_size=32, norm_topk_prob=True,
        router_kind="softmax_topk", router_bias=False, expert_act="silu", expert_bias=bias,
        quant=QuantConfig("mxfp4") if fmt == "mxfp4" else None,
    )


def make_store(fmt: str = "dense", bias: bool = False, seed: int = 0, **kw: int) -> HostExpertStore:
    cfg = _cfg(fmt, bias=bias, **kw)
    store = HostExpertStore(cfg, torch.float32, pin=False)
    gen = torch.Generator().manual_seed(seed)
    form = get_format(cfg.expert_format)
    for layer in cfg.moe_layers:
        banks = form.random_banks(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, bias,
                                  torch.float32, gen)
        for name, t in banks.items():
            store.banks[layer][name].copy_(t)
    return store


class RecordingTransfer(SyncTransfer):
    """SyncTransfer that logs every call: the fake device's view of the ordering."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []

    def fetch(self, copies: list[Copy], slots: list[int], demand: bool) -> None:
        self.log.append(("fetch", tuple(slots), demand, len(copies)))
        super().fetch(copies, slots, demand)

    def wait(self, slots: list[int]) -> None:
        self.log.append(("wait", tuple(slots)))

    def mark_used(self, slots: list[int]) -> None:
        self.log.append(("used", tuple(slots)))


# ---- SlotTable -------------------------------------------------------------------------------
def test_slots_fill_lowest_first_then_evict_lru_in_order() -> None:
    t = SlotTable(3, LRUPolicy())
    look = t.acquire([10, 11])
    assert look.slots == [0, 1] and look.filled == [(10, 0), (11, 1)] and look.hits == []
    t.release([10, 11])
    look = t.acquire([12, 10])
    assert look.slots == [2, 0] and look.hits == [10] and look.evicted == []
    t.release([12, 10])
    look = t.acquire([13, 14])  # LRU order now: 11, 12, 10
    assert look.evicted == [11, 12] and look.filled == [(13, 1), (14, 2)]
    t.release([13, 14])
    assert t.slot_of == {10: 0, 13: 1, 14: 2}


@pytest.mark.parametrize("policy,victim", [("lru", 1), ("lrfu", 2)])
def test_exact_eviction_under_each_policy_on_the_fake_device(policy: str, victim: int) -> None:
    """Expert 1 is used most, 2 and 3 most recently: LRU drops 1, LRFU (half-life 16 steps) drops
    2, whose CRF 2^(-5/16) + 2^(-2/16) is the smallest; the new expert lands in the victim's slot."""
    store = make_store()
    cache = ExpertCache(store, 3, torch.device("cpu"), make_policy(policy), RecordingTransfer())
    for step in ([1, 2, 3], [1], [1], [2], [3]):
        cache.begin_step()
        cache.release(0, step, cache.acquire(0, step))
    cache.begin_step()
    slots = cache.acquire(0, [4])
    assert cache.counters.evictions == 1 and slots == [victim - 1]  # slots 0, 1, 2 hold 1, 2, 3
    assert not cache.contains(0, victim) and cache.contains(0, 4)
    assert torch.equal(cache.pool.flat[slots[0]], store.flat[0][4])


def test_pinned_experts_are_never_evicted() -> None:
    t = SlotTable(3, LRUPolicy())
    t.acquire([1, 2])  # in use, not released
    t.acquire([3])
    t.release([3])
    look = t.acquire([4])  # 1 and 2 are older but pinned
    assert look.evicted == [3] and look.slots == [2]
    with pytest.raises(ValueError, match="1 experts to pin but only 0 of 3 slots"):
        t.acquire([5])
    t.release([1])
    assert t.acquire([5]).evicted == [1]


def test_table_rejects_bad_calls() -> None:
    t = SlotTable(2, LRUPolicy())
    with pytest.raises(ValueError, match="distinct"):
        t.acquire([1, 1])
    with pytest.raises(ValueError, match="3 experts to pin but only 2"):
        t.acquire([1, 2, 3])
    t.acquire([1])
    t.release([1])
    with pytest.raises(ValueError, match="not pinned"):
        t.release([1])
    with pytest.raises(ValueError, match="at least 1 slot"):
        SlotTable(0, LRUPolicy())


def test_admit_fills_free_slots_without_touching_pinned_or_its_own() -> None:
    t = SlotTable(4, LRUPolicy())
    t.acquire([1, 2])  # pinned (the layer computing now)
    look = t.admit([7, 8, 9])  # room for two
    assert look.filled == [(7, 2), (8, 3)] and look.evicted == []
    assert not t.is_pinned(7) and t.available() == 2
    t.release([1, 2])
    look = t.acquire([9])  # prefetched-but-unused keys go first (LRU: the last admitted), before 1, 2
    assert look.evicted == [8]


def test_lru_replay_matches_trace_lru_hit_rate() -> None:
    """The table + LRU policy against tools.demo_model.trace.lru_hit_rate, one layer, zipf-like ids."""
    gen = torch.Generator().manual_seed(0)
    probs = 1.0 / torch.arange(1, 33).float()
    ids = torch.stack([torch.multinomial(probs, 4, generator=gen) for _ in range(600)])  # [T, 4]
    ids = ids.sort(dim=1).values
    for cap in (4, 8, 16):
        t, hits = SlotTable(cap, LRUPolicy()), 0
        for row in ids.tolist():
            hits += len(t.acquire(row).hits)
            t.release(row)
        assert hits / ids.numel() == pytest.approx(lru_hit_rate(ids, cap), abs=1e-12)


def test_coalesce_runs() -> None:
    assert coalesce([(8, 9), (4, 1), (3, 0), (5, 2), (7, 3)]) == [(3, 0, 3), (7, 3, 1), (8, 9, 1)]
    assert coalesce([]) == []


# ---- host store ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,bias", [("dense", False), ("mxfp4", True)])
def test_host_store_keeps_each_expert_contiguous(fmt: str, bias: bool) -> None:
    store = make_store(fmt, bias)
    layout = store.layout
    assert layout.row_bytes % ALIGN == 0
    spec_bytes = get_format(fmt).expert_bytes(64, 32, bias, torch.float32)
    assert spec_bytes <= layout.row_bytes < spec_bytes + ALIGN * len(layout.offsets)
    for layer, flat in store.flat.items():
        assert flat.shape == (8, layout.row_bytes) and flat.is_contiguous()
        for name, bank in store.banks[layer].items():
            for e in (0, 5):
                assert bank[e].is_contiguous()
                assert bank[e].data_ptr() - flat[e].data_ptr() == layout.offsets[name]
    get_format(fmt).check_banks(store.banks[0])  # shapes and dtypes of an ordinary store


def test_host_store_pinning_failure_warns_and_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("pinning works here")
    with caplog.at_level(logging.WARNING, logger="ferryman.experts"):
        store = HostExpertStore(_cfg(), torch.float32, pin=True)
    assert not store.pinned and store.pinned_layers == 0
    assert "could not pin host memory for the experts of 3 of 3 MoE layers" in caplog.text


@pytest.mark.gpu
def test_host_store_is_pinned_on_cuda() -> None:
    assert HostExpertStore(_cfg(), torch.bfloat16, pin=True).pinned


# ---- ExpertCache -----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,bias", [("dense", False), ("mxfp4", True)])
def test_fetched_slots_hold_the_experts_byte_exact(fmt: str, bias: bool) -> None:
    store = make_store(fmt, bias)
    rec = RecordingTransfer()
    cache = ExpertCache(store, 4, torch.device("cpu"), LRUPolicy(), rec)
    slots = cache.acquire(1, [2, 3, 4])
    assert slots == [0, 1, 2]
    assert rec.log[0] == ("fetch", (0, 1, 2), True, 1)  # consecutive experts into consecutive slots: one copy
    assert rec.log[1] == ("wait", (0, 1, 2))
    for e, s in zip([2, 3, 4], slots):
        for name, bank in cache.banks.items():
            assert torch.equal(bank[s], store.banks[1][name][e]), (name, e)
    assert rec.bytes == 3 * store.layout.row_bytes


def offload_of(store: HostExpertStore, slots: int,
               guesser: NextLayerGuesser | None = None) -> tuple[OffloadExperts, RecordingTransfer]:
    rec = RecordingTransfer()
    cache = ExpertCache(store, slots, torch.device("cpu"), LRUPolicy(), rec)
    return OffloadExperts(cache, MoEActivation("silu"), guesser), rec


def make_routing(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 64, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)
    return x, ids, w


def test_batch_shares_one_lookup_and_matches_resident() -> None:
    store = make_store()
    backend, rec = offload_of(store, 6)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[1, 4], [4, 1], [2, 4], [1, 2], [4, 6]])  # 4 distinct experts, 10 pairs
    w = torch.softmax(torch.randn(5, 2, generator=torch.Generator().manual_seed(4)), dim=-1)
    out = backend.forward(0, x, ids, w)
    want = fused_moe("dense", store.banks[0], x, ids, w, MoEActivation("silu"))
    assert torch.equal(out, want)  # K = 2: the sum of two terms does not depend on slot order
    st = backend.stats()
    assert (st["misses"], st["hits"]) == (4, 0), "each expert fetched once for the whole batch"
    assert [c[0] for c in rec.log] == ["fetch", "wait", "used"]
    backend.forward(0, x, ids, w)
    st = backend.stats()
    assert (st["misses"], st["hits"], st["per_layer_hit_rate"][0]) == (4, 4, 0.5)
    assert st["bytes_h2d"] == rec.bytes and st["stall_seconds"] <= st["h2d_seconds"]


@pytest.mark.parametrize("bad", [-1, 8, 2**62])
def test_expert_ids_out_of_range_name_the_layer(bad: int) -> None:
    """CUDA's top-k returns arbitrary indices for NaN router scores; such an id must stop the layer
    with a clear error, not reach a host-store row that does not exist (an empty copy)."""
    store = make_store()
    backend, rec = offload_of(store, 6)
    x = torch.randn(2, 64)
    ids = torch.tensor([[1, bad], [4, 1]])
    with pytest.raises(RuntimeError, match=rf"MoE layer 0: the router chose expert {bad}, outside \[0, 8\)"):
        backend.forward(0, x, ids, torch.full((2, 2), 0.5))
    assert rec.log == []


def test_union_larger_than_the_cache_runs_in_rounds() -> None:
    store = make_store(seed=5)
    backend, rec = offload_of(store, 2)
    x, ids, w = make_routing(9, 8, 2, seed=6)
    used = len(ids.unique())
    out = backend.forward(2, x, ids, w)
    want = fused_moe("dense", store.banks[2], x, ids, w, MoEActivation("silu"))
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-6)
    st = backend.stats()
    assert st["misses"] == used and st["slots"] == 2
    # every round: fetch into free/evictable slots, wait, then release; never more than 2 in use
    kinds = [c[0] for c in rec.log]
    assert kinds == ["fetch", "wait", "used"] * (-(-used // 2))
    assert all(len(c[1]) <= 2 for c in rec.log)


class FixedGate(torch.nn.Module):
    """A router whose top-k is always `experts`."""

    def __init__(self, experts: list[int], num_experts: int = 8) -> None:
        super().__init__()
        self.logits = torch.full((num_experts,), -1.0)
        self.logits[experts] = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(x.shape[0], -1)


def test_next_layer_guess_is_prefetched_then_hit() -> None:
    store = make_store()
    gates = {0: FixedGate([0, 1]), 1: FixedGate([5, 6]), 2: FixedGate([0, 1])}
    backend, rec = offload_of(store, 6, NextLayerGuesser(gates, top_k=2))
    x, _, w = make_routing(1, 8, 2, seed=7)
    backend.forward(0, x, torch.tensor([[2, 3]]), w)
    # layer 0's misses, the kernel, then the guess for layer 1 (experts 5, 6): its copies start
    # after every input of the kernel was issued
    assert rec.log == [("fetch", (0, 1), True, 1), ("wait", (0, 1)), ("used", (0, 1)), ("fetch", (2, 3), False, 1)]
    backend.forward(1, x, torch.tensor([[6, 7]]), w)  # one right guess, one miss
    st = backend.stats()
    assert st["prefetch_hits"] == 1 and st["prefetch_fetched"] == 4  # 5, 6 for layer 1; 0, 1 for layer 2
    assert st["per_layer_guess"][1]["recall"] == 0.5 and st["per_layer_guess"][1]["precision"] == 0.5


def test_prefetch_turns_off_where_guesses_are_wrong() -> None:
    store = make_store()
    gates = {0: FixedGate([0, 1]), 1: FixedGate([5, 6]), 2: FixedGate([0, 1])}
    guesser = NextLayerGuesser(gates, top_k=2, min_samples=8)
    backend, _ = offload_of(store, 8, guesser)
    x, _, w = make_routing(1, 8, 2, seed=8)
    for step in range(12):
        backend.forward(0, x, torch.tensor([[2, 3]]), w)
        backend.forward(1, x, torch.tensor([[(step % 2) + 1, 7]]), w)  # never 5 or 6
        backend.forward(2, x, torch.tensor([[0, 1]]), w)  # always right
    g = guesser.stats()["per_layer_guess"]
    assert g[1]["prefetch"] is False and g[1]["precision"] == 0.0
    assert g[2]["prefetch"] is True and g[2]["recall"] == 1.0


def test_one_sequence_grades_do_not_turn_batches_off() -> None:
    """A layer whose one-token guesses are wrong stops guessing for one sequence but still guesses
    for batches, graded apart (a batch's union of guesses is right far more often)."""
    store = make_store()
    gates = {0: FixedGate([0, 1]), 1: FixedGate([5, 6]), 2: FixedGate([0, 1])}
    guesser = NextLayerGuesser(gates, top_k=2, min_samples=8)
    backend, _ = offload_of(store, 8, guesser)
    x1, _, w1 = make_routing(1, 8, 2, seed=8)
    x3, _, w3 = make_routing(3, 8, 2, seed=9)
    for step in range(12):  # one sequence: layer 1's guess (5, 6) is never used
        backend.forward(0, x1, torch.tensor([[2, 3]]), w1)
        backend.forward(1, x1, torch.tensor([[(step % 2) + 1, 7]]), w1)
    assert not guesser.wants_prefetch(1, False, seqs=1) and guesser.wants_prefetch(1, False, seqs=3)
    for _ in range(12):  # three sequences: 5 and 6 are used
        backend.forward(0, x3, torch.tensor([[2, 3], [2, 4], [3, 4]]), w3)
        backend.forward(1, x3, torch.tensor([[5, 7], [6, 7], [5, 6]]), w3)
    g = guesser.stats()["per_layer_guess"][1]
    assert g["prefetch"] is False and g["precision"] == 0.0
    assert g["batch_prefetch"] is True and g["batch_precision"] == 1.0


def test_prefetch_victims_skip_slots_a_pending_kernel_reads() -> None:
    """A guess's copy into a slot whose reading kernel may still run would hold the whole batch
    back: such victims go last, and are still taken when nothing else is left."""
    t = SlotTable(3, LRUPolicy())
    t.acquire([10, 11, 12])
    t.release([10, 11, 12])  # LRU order: 10, 11, 12 in slots 0, 1, 2
    look = t.admit([20], avoid=lambda slot: slot == 0)
    assert look.evicted == [11] and look.filled == [(20, 1)]
    look = t.admit([21], avoid=lambda slot: True)  # every victim busy: the policy's own choice,
    assert look.evicted == [20] and look.filled == [(21, 1)]  # the unreferenced prefetched key


def test_pinned_rows_own_their_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """cudaHostRegister refuses a page already registered: small buffers (tiny models) must not share
    a page, so each registered range is page-aligned, whole pages, and inside its own allocation."""
    import mmap

    from ferryman.quant import layout

    ranges: list[tuple[int, int]] = []
    monkeypatch.setattr(layout, "_register", lambda flat, nbytes: ranges.append((flat.data_ptr(), nbytes)) or True)
    bufs = [layout.allocate_rows(3, 1000, pin=True) for _ in range(4)]  # 3000 bytes each: under a page
    page = mmap.PAGESIZE
    for (flat, pinned), (ptr, n) in zip(bufs, ranges):
        assert pinned and flat.shape == (3, 1000) and flat.is_contiguous() and flat.data_ptr() == ptr
        assert ptr % page == 0 and n % page == 0 and n >= flat.numel()
        base = flat.untyped_storage().data_ptr()
        assert base <= ptr and ptr + n <= base + flat.untyped_storage().nbytes()
    pages = [set(range(p // page, (p + n) // page)) for p, n in ranges]
    assert all(not (a & b) for i, a in enumerate(pages) for b in pages[i + 1:])
