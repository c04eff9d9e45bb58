"""Link-read decode steps (experts/link_table.py, engine/segment_graphs.py `link=True`): each MoE
layer maps expert ids through the device table, experts not in a slot are read from the host bank,
and the cache's bookkeeping runs once per step. Greedy tokens equal the resident engine's; the
misses of a step are cached for the next ones; the table never names a slot whose expert left it.
CPU: the same functions run eagerly; CUDA (gpu): one captured graph per step, pinned host banks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferryman import LLM
from ferryman.engine.segment_graphs import SegmentedDecode
from ferryman.models.registry import model_config
from tiny_models import build_tiny, count_calls, greedy_ids

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33)), [(i * 37) % 250 + 3 for i in range(29)]]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One tiny architecture for the bookkeeping tests, which do not depend on it."""
    folder = tmp_path_factory.mktemp("qwen3_moe")
    build_tiny("qwen3_moe", folder)
    return "qwen3_moe", folder


def _offload_with_link(folder: Path, tokens: int, device: str = "cpu") -> tuple[LLM, LLM]:
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
                                    capture=False, link=True)
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


def test_settle_caches_a_steps_misses_and_publish_names_only_cached_slots(qwen3: tuple[str, Path]) -> None:
    """After a step, its misses are offered to the cache (the policy picks victims), and the next published
    table maps every expert to its slot, or to -1 - e when it has none."""
    _, folder = qwen3
    _, offload = _offload_with_link(folder, 4)
    greedy_ids(offload, PROMPTS[:1], 4)
    seg = offload.engine.runner.graphs
    assert isinstance(seg, SegmentedDecode) and seg.link is not None
    link, cache = seg.link, offload.engine.runner.experts.cache
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
