"""Per-layer decode graphs of offloaded models (engine/segment_graphs.py): the segments (attention +
router of each layer, the dense MLP of layers without experts, the final norm + lm_head) with the
MoE run eagerly between them give the resident engine's greedy tokens. On CPU the same segment
functions run eagerly over the same static buffers (padding rows included); on CUDA they are
captured as graphs (gpu)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferryman import LLM
from ferryman.engine.segment_graphs import SegmentedDecode
from tiny_models import greedy_ids

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33)), [(i * 37) % 250 + 3 for i in range(29)]]


def _count_runs(seg: SegmentedDecode) -> list[int]:
    calls = [0]
    run = seg.run

    def counted(inputs):  # noqa: ANN001, ANN202
        calls[0] += 1
        return run(inputs)

    seg.run = counted  # type: ignore[method-assign]
    return calls


def test_segments_on_cpu_equal_resident(tiny: tuple[str, Path]) -> None:
    arch, folder = tiny
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=16, enforce_eager=True)
    want = greedy_ids(LLM(str(folder), **kw), PROMPTS, 12)
    offload = LLM(str(folder), moe_strategy="offload", expert_cache="25%", **kw)
    runner = offload.engine.runner
    # 3 sequences run in the bucket of 4: one padding row through every segment
    runner.graphs = seg = SegmentedDecode(runner.model, 4, 64, offload.engine.max_model_len, runner.device,
                                          capture=False)
    calls = _count_runs(seg)
    assert greedy_ids(offload, PROMPTS, 12) == want, f"{arch}: per-layer decode differs from resident"
    assert calls[0] >= 11  # every decode step went through the segments
    st = offload.stats()["experts"]
    assert st["misses"] > 0 and st["hits"] > 0


@pytest.mark.gpu
def test_cuda_layer_graphs_equal_resident_and_are_used(tiny: tuple[str, Path]) -> None:
    arch, folder = tiny
    kw = dict(device="cuda", dtype="float32", max_num_batched_tokens=16)
    want = greedy_ids(LLM(str(folder), enforce_eager=True, **kw), PROMPTS, 12)
    offload = LLM(str(folder), moe_strategy="offload", expert_cache="25%", max_num_seqs=4, **kw)
    assert offload.stats()["cuda_graph_mode"] == "layer"
    seg = offload.engine.runner.graphs
    assert isinstance(seg, SegmentedDecode) and sorted(seg.graphs) == [1, 2, 4]
    calls = _count_runs(seg)
    assert greedy_ids(offload, PROMPTS, 12) == want, f"{arch}: per-layer graphs differ from resident"
    assert calls[0] >= 11
