"""Per-layer decode graphs of offloaded models (engine/segment_graphs.py): the segments (attention +
router of each layer, the dense MLP of layers without experts, the final norm + lm_head) with the
MoE run eagerly between them give the resident engine's greedy tokens. On CPU the same segment
functions run eagerly over the same static buffers (padding rows included); on CUDA they are
captured as graphs (gpu)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from ferryman import LLM
from ferryman.engine.segment_graphs import SegmentedDecode
from ferryman.models.registry import model_config
from tiny_models import count_calls, greedy_ids

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33)), [(i * 37) % 250 + 3 for i in range(29)]]


def _count_runs(seg: SegmentedDecode) -> list[int]:
    return count_calls(seg, "run")


def _count_moe(seg: SegmentedDecode) -> list[int]:
    return count_calls(seg, "_moe")


def _cpu_offload_with_segments(folder: Path, tokens: int) -> tuple[list[list[int]], LLM, SegmentedDecode]:
    """(resident greedy tokens, an offloaded LLM with a 25% cache, its CPU SegmentedDecode): 3
    sequences run in the bucket of 4, one padding row through every segment."""
    if model_config(folder).linear_attn is not None:
        pytest.skip("linear-attention models decode without the per-layer graphs")
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=16, enforce_eager=True)
    want = greedy_ids(LLM(str(folder), **kw), PROMPTS, tokens)
    offload = LLM(str(folder), moe_strategy="offload", expert_cache="25%", **kw)
    runner = offload.engine.runner
    runner.graphs = seg = SegmentedDecode(runner.model, 4, 64, offload.engine.max_model_len, runner.device,
                                          capture=False)
    return want, offload, seg


def test_segments_on_cpu_equal_resident(tiny: tuple[str, Path]) -> None:
    arch, folder = tiny
    want, offload, seg = _cpu_offload_with_segments(folder, 12)
    calls = _count_runs(seg)
    moe_runs = _count_moe(seg)
    assert greedy_ids(offload, PROMPTS, 12) == want, f"{arch}: per-layer decode differs from resident"
    assert calls[0] >= 11  # every decode step went through the segments
    # MoE layers ran their (here: eager) MoE graph function on slot ids, except in steps with more
    # (token, k) pairs than the 25% cache has slots (those run in rounds, eagerly)
    assert 0 < moe_runs[0] <= calls[0] * len(seg.moe)
    st = offload.stats()["experts"]
    assert st["misses"] > 0 and st["hits"] > 0 and st["prefetch_fetched"] > 0
    assert offload.engine.runner.experts.cache.table.num_pinned == 0  # every step released its slots


def test_rebound_backend_runs_its_moe_eagerly(tiny: tuple[str, Path]) -> None:
    """A backend bound after the graphs were captured (rebind_experts) has other slot banks than
    the captured MoE graphs read: those steps run the MoE eagerly, with the same tokens."""
    arch, folder = tiny
    want, offload, seg = _cpu_offload_with_segments(folder, 8)
    old = weakref.ref(offload.engine.runner.experts)
    offload.engine.runner.rebind_experts(policy="lru")
    gc.collect()
    assert old() is None, "the graphs still hold the old backend (and its slot pool) after a rebind"
    moe_runs = _count_moe(seg)
    assert greedy_ids(offload, PROMPTS, 8) == want, f"{arch}: eager MoE after a rebind differs"
    assert moe_runs[0] == 0


@pytest.mark.gpu
def test_cuda_layer_graphs_equal_resident_and_are_used(tiny: tuple[str, Path]) -> None:
    arch, folder = tiny
    if model_config(folder).linear_attn is not None:
        pytest.skip("linear-attention models decode without the per-layer graphs")
    kw = dict(device="cuda", dtype="float32", max_num_batched_tokens=16)
    want = greedy_ids(LLM(str(folder), enforce_eager=True, **kw), PROMPTS, 12)
    offload = LLM(str(folder), moe_strategy="offload", expert_cache="25%", max_num_seqs=4, decode_misses="copy", **kw)
    assert offload.stats()["cuda_graph_mode"] == "layer"  # the copy path's graphs (link steps: test_link_reads.py)
    seg = offload.engine.runner.graphs
    assert isinstance(seg, SegmentedDecode) and sorted(seg.graphs) == [1, 2, 4]
    assert all(("moe", i) in seg.graphs[bs] for i in seg.moe for bs in (1, 2, 4))  # MoE kernels as graphs
    # an untied token-embedding table stays in host RAM; the graphs read the rows `fill` copies in
    untied = not offload.engine.cfg.tie_word_embeddings
    assert (offload.engine.runner.model.embed_tokens.weight.device.type == "cpu") == untied
    assert (seg.static.embeds is not None) == untied
    calls = _count_runs(seg)
    assert greedy_ids(offload, PROMPTS, 12) == want, f"{arch}: per-layer graphs differ from resident"
    assert calls[0] >= 11
