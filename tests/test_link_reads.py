"""Link-read decode steps (experts/link_table.py, engine/segment_graphs.py `link=True`): each MoE
layer maps expert ids through the device table, experts not in a slot are read from the host bank,
and the cache's bookkeeping runs once per step. Greedy tokens equal the resident engine's; the
misses of a step are cached for the next ones; the table never names a slot whose expert left it.
CPU: the same functions run eagerly; CUDA (gpu): one captured graph per step, pinned host banks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ferryman import LLM
from ferryman.engine.segment_graphs import SegmentedDecode
from ferryman.experts.gpu_cache import ExpertCache
from ferryman.experts.link_table import LinkTable
from ferryman.experts.split_trial import SplitTrial, link_reads_trial
from ferryman.models.registry import model_config
from tiny_models import build_tiny, count_calls, greedy_ids

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33)), [(i * 37) % 250 + 3 for i in range(29)]]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One tiny architecture for the bookkeeping tests, which do not depend on it."""
    folder = tmp_path_factory.mktemp("qwen3_moe")
    build_tiny("qwen3_moe", folder)
    return "qwen3_moe", folder


def _offload_with_link(folder: Path, tokens: int, device: str = "cpu",
                       trial: SplitTrial | None = None) -> tuple[LLM, LLM]:
    """(the resident LLM, an offloaded one with a 25% cache whose decode steps take link reads)."""
    if model_config(folder).linear_attn is not None:
        pytest.skip("linear-attention models decode without the per-layer graphs")
    kw = dict(device=device, dtype="float32", max_num_batched_tokens=16)
    resident = LLM(str(folder), enforce_eager=True, **kw)
    if device == "cuda":  # link forced: the planner keeps MXFP4 experts (tiny gpt_oss) on the copy path
        return resident, LLM(str(folder), expert_cache="25%", decode_misses="link", **kw)
    offload = LLM(str(folder), moe_strategy="offload", expert_cache="25%", enforce_eager=True, **kw)
    runner = offload.engine.runner
    runner.graphs = SegmentedDecode(runner.model, 4, 64, offload.engine.max_model_len, runner.device,
                                    capture=False, link=True, trial=trial)
    return resident, offload


def test_link_steps_on_cpu_equal_resident(tiny: tuple[str, Path]) -> None:
    """One sequence at a time: every decode step a link step. Three together: their pairs
    outnumber half the tiny models' 8 experts (LINK_MAX_SHARE), so the steps take the copy path,
    after the link steps' bookkeeping."""
    arch, folder = tiny
    resident, offload = _offload_with_link(folder, 12)
    seg = offload.engine.runner.graphs
    assert isinstance(seg, SegmentedDecode) and seg.link is not None
    steps = count_calls(seg, "_link_step")
    for p in PROMPTS:
        assert greedy_ids(offload, [p], 12) == greedy_ids(resident, [p], 12), f"{arch}: link-read decode differs"
    assert steps[0] >= 3 * 11  # every decode step of a lone sequence ran as one link step
    assert greedy_ids(offload, PROMPTS, 12) == greedy_ids(resident, PROMPTS, 12), f"{arch}: copy steps after link"
    st = offload.stats()["experts"]
    assert st["misses"] > 0 and st["hits"] > 0  # settle counted both
    assert st["link_reads"] > 0 and st["link_read_bytes"] > 0  # some pairs read their expert from the host bank
    assert offload.engine.runner.experts.cache.table.num_pinned == 0


def _link_after_decode(folder: Path) -> tuple[LinkTable, ExpertCache]:
    """The link table and cache of an offloaded LLM (25% cache) that decoded a few link steps."""
    _, offload = _offload_with_link(folder, 4)
    greedy_ids(offload, PROMPTS[:1], 4)
    seg = offload.engine.runner.graphs
    assert isinstance(seg, SegmentedDecode) and seg.link is not None
    return seg.link, offload.engine.runner.experts.cache


def test_settle_counts_each_layers_hits_misses_and_link_reads(qwen3: tuple[str, Path]) -> None:
    """A logged step of two rows: per layer, its distinct cached experts count as hits, the others as
    misses, and every (row, k) pair whose expert was uncached as one link read of its bytes."""
    link, cache = _link_after_decode(qwen3[1])
    link.settle()  # the last decode step's bookkeeping first
    c = cache.counters
    L, k, e = len(link.layers), link.log.shape[2], cache.num_experts
    gen = torch.Generator().manual_seed(3)
    rows = torch.stack([torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(2)]) for _ in range(L)])
    rows[0, 1] = rows[0, 0]  # a layer whose two rows share their experts
    link.log[:, :2] = rows.to(torch.int32)  # [L, 2, K]
    want = {}
    for m, layer in enumerate(link.layers):
        used = set(rows[m].reshape(-1).tolist())
        cached = {x for x in used if cache.contains(layer, x)}
        reads = sum(1 for x in rows[m].reshape(-1).tolist() if x not in cached)
        want[layer] = (len(cached), len(used) - len(cached), reads)
    before = ({la: c.hits.get(la, 0) for la in link.layers}, {la: c.misses.get(la, 0) for la in link.layers},
              c.link_reads, c.link_read_bytes)
    link.logged(2)
    link.settle()
    got = {la: (c.hits.get(la, 0) - before[0][la], c.misses.get(la, 0) - before[1][la]) for la in link.layers}
    assert got == {la: w[:2] for la, w in want.items()}
    assert c.link_reads - before[2] == sum(w[2] for w in want.values()) > 0
    assert c.link_read_bytes - before[3] == sum(w[2] * link.expert_bytes[la] for la, w in want.items())


def test_settle_caches_a_steps_misses_and_publish_names_only_cached_slots(qwen3: tuple[str, Path]) -> None:
    """After a step, its misses are offered to the cache (the policy picks victims), and the next published
    table maps every expert to its slot, or to -1 - e when it has none."""
    link, cache = _link_after_decode(qwen3[1])
    link.log[:, :1] = torch.arange(link.log.shape[2], dtype=torch.int32)  # one row: experts 0..K-1 everywhere
    link.logged(1)
    link.settle()
    e, k = cache.num_experts, link.log.shape[2]
    uncached = [(layer, x) for layer in link.layers for x in range(k) if not cache.contains(layer, x)]
    # a miss stays uncached only when the policy kept every slot's expert (none free)
    assert not uncached or not cache.table.free, f"misses {uncached} left out while slots were free"
    assert any(cache.contains(layer, x) for layer in link.layers for x in range(k))
    link.publish()
    table = link.table.cpu()
    for m in range(len(link.layers)):
        for x in range(e):
            slot = cache.table.slot_of.get(m * e + x)
            assert table[m, x].item() == (slot if slot is not None else -1 - x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_link_steps_equal_resident(tiny: tuple[str, Path]) -> None:
    arch, folder = tiny
    resident, offload = _offload_with_link(folder, 12, "cuda")
    seg = offload.engine.runner.graphs
    assert isinstance(seg, SegmentedDecode) and seg.link is not None, "link steps were not set up"
    assert offload.engine.plan.decode_misses == "link" and offload.stats()["cuda_graph_mode"] == "link"
    for p in PROMPTS:
        assert greedy_ids(offload, [p], 12) == greedy_ids(resident, [p], 12), f"{arch}: CUDA link-read decode differs"
    assert greedy_ids(offload, PROMPTS, 12) == greedy_ids(resident, PROMPTS, 12), f"{arch}: CUDA copy steps after link"
    assert offload.stats()["experts"]["link_reads"] > 0


def test_link_steps_follow_slots_that_leave_and_join_the_cache(qwen3: tuple[str, Path]) -> None:
    """Slots the KV cache takes back (reclaim_slot, engine/memory_split.py) and lends again between
    link steps: the next published table never names a slot the cache gave up, and tokens stay
    the resident engine's."""
    arch, folder = qwen3
    resident, offload = _offload_with_link(folder, 8)
    cache = offload.engine.runner.experts.cache
    seg = offload.engine.runner.graphs
    assert isinstance(seg, SegmentedDecode) and seg.link is not None
    assert greedy_ids(offload, [PROMPTS[0]], 8) == greedy_ids(resident, [PROMPTS[0]], 8)
    taken = [cache.reclaim_slot(), cache.reclaim_slot()]
    assert None not in taken
    seg.link.settle()
    seg.link.publish()
    named = set(seg.link.table.flatten().tolist())
    assert not named & set(taken), f"{arch}: the table names slots {named & set(taken)} the cache gave up"
    assert greedy_ids(offload, [PROMPTS[1]], 8) == greedy_ids(resident, [PROMPTS[1]], 8), f"{arch}: after reclaim"
    for slot in taken:
        cache.lend_slot(slot)
    assert greedy_ids(offload, [PROMPTS[2]], 8) == greedy_ids(resident, [PROMPTS[2]], 8), f"{arch}: after lend"


@pytest.mark.parametrize("keep", [True, False])
def test_link_reads_on_trial_alternate_with_copies_until_a_verdict(qwen3: tuple[str, Path], keep: bool) -> None:
    """auto's link reads on trial (experts/split_trial.link_reads_trial): one sequence's decode steps
    run link steps and copy steps in turns of `window`; the verdict (forced here by the margin) keeps
    link steps, or turns them off for good. Tokens are the resident engine's throughout."""
    arch, folder = qwen3
    trial = dataclasses.replace(link_reads_trial(), window=3, min_steps=2, skip=1, margin=-100.0 if keep else 2.0)
    resident, offload = _offload_with_link(folder, 12, trial=trial)
    seg = offload.engine.runner.graphs
    assert isinstance(seg, SegmentedDecode) and seg.trial is trial
    link_steps = count_calls(seg, "_link_step")
    copy_steps = count_calls(seg, "_moe_step")
    assert greedy_ids(offload, [PROMPTS[0]], 12) == greedy_ids(resident, [PROMPTS[0]], 12), f"{arch}: on trial"
    # 11 decode steps: 3 link, 3 copy (the verdict at 2 timed steps each way: the first of each window
    # is not timed), then 5 the verdict's way
    assert trial.verdict is keep and trial.steps == 6
    layers = len(seg.moe)
    assert link_steps[0] == (8 if keep else 3) and copy_steps[0] == (3 if keep else 8) * layers
    assert (seg.link is not None) is keep
    split = offload.engine.memory_split()  # what `ferryman ctl` shows
    assert split["miss_path"] == ("link" if keep else "layer") and split["link_trial"]["verdict"] is keep
    st = offload.stats()
    assert st["link_trial"]["verdict"] is keep
    assert ("kept" if keep else "fell back to copies") in st["link_trial"]["reason"]
    assert greedy_ids(offload, PROMPTS, 12) == greedy_ids(resident, PROMPTS, 12), f"{arch}: after the verdict"
    assert trial.steps == 6  # final: later steps are not counted


def test_only_autos_link_reads_stand_on_trial_and_warm_up_restarts_its_samples(qwen3: tuple[str, Path]) -> None:
    """decode_misses auto that picked link reads puts them on trial; link asked for is not; the
    warm-up's steps (compiles) are not samples."""
    _, folder = qwen3
    kw = dict(device="cpu", dtype="float32", moe_strategy="offload", expert_cache="25%", enforce_eager=True)
    auto, forced = LLM(str(folder), **kw), LLM(str(folder), decode_misses="link", **kw)
    assert auto.engine.plan.decode_misses == forced.engine.plan.decode_misses == "link"
    assert auto.engine.runner.link_on_trial and not forced.engine.runner.link_on_trial
    runner = auto.engine.runner
    runner.graphs = seg = SegmentedDecode(runner.model, 4, 64, auto.engine.max_model_len, runner.device,
                                          capture=False, link=True, trial=link_reads_trial())
    greedy_ids(auto, [PROMPTS[0]], 6)
    assert seg.trial is not None and seg.trial.steps == 5 and auto.stats()["link_trial"]["steps"] == 5
    auto.engine.reset_after_warm_up()
    assert seg.trial.steps == 0 and seg.trial.times == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_link_trial_replays_both_ways_and_falls_back_to_copies(qwen3: tuple[str, Path]) -> None:
    """On CUDA, auto's link reads on trial: both the link step and the segments are captured at the
    link sizes; after a verdict against link (forced by the margin), the segment graphs serve."""
    arch, folder = qwen3
    kw = dict(device="cuda", dtype="float32", max_num_batched_tokens=16)
    resident = LLM(str(folder), enforce_eager=True, **kw)
    auto = LLM(str(folder), expert_cache="25%", **kw)
    seg = auto.engine.runner.graphs
    assert isinstance(seg, SegmentedDecode) and seg.link is not None and seg.trial is not None
    assert ("step", len(seg.model.layers)) in seg.graphs[1] and ("seg", 0) in seg.graphs[1]
    seg.trial.window, seg.trial.min_steps, seg.trial.skip, seg.trial.margin = 3, 2, 1, 2.0
    assert greedy_ids(auto, [PROMPTS[0]], 12) == greedy_ids(resident, [PROMPTS[0]], 12), f"{arch}: on trial"
    assert seg.trial.verdict is False and seg.link is None and auto.stats()["cuda_graph_mode"] == "layer"
    assert greedy_ids(auto, PROMPTS, 12) == greedy_ids(resident, PROMPTS, 12), f"{arch}: after the verdict"
