"""Wrap guesses: in decode steps the last MoE layer copies what the
first used in this step, for the next step; graded like the full guesses; answers unchanged."""

from __future__ import annotations

import pytest
import torch

from ferryman import LLM
from ferryman.experts.guesses import NextLayerGuesser
from tiny_models import greedy_ids

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def test_only_the_last_layer_wraps_and_the_gate_applies() -> None:
    gates = {2: torch.nn.Linear(4, 8), 5: torch.nn.Linear(4, 8), 7: torch.nn.Linear(4, 8)}
    g = NextLayerGuesser(gates, top_k=2, min_samples=4)
    assert (g.first, g.last) == (2, 7) and set(g.counters) == {2, 5, 7}
    assert g.wants_wrap(7, seqs=16) and not g.wants_wrap(5, seqs=1) and not g.wants_wrap(7, seqs=17)
    for _ in range(4):  # never right: the gate turns the wrap guess off
        g.remember(2, [1, 2], [1, 2], streaming=False)
        g.score(2, [3, 4])
    assert not g.wants_wrap(7, seqs=1)
    assert not NextLayerGuesser(gates, top_k=2, decode=False).wants_wrap(7, seqs=1)
    g.first_used = None
    assert g.wrap(2, [1, 3], rows=1, streaming=False) is None and g.first_used == [1, 3]
    assert g.wrap(7, [4], rows=1, streaming=False) is None  # the gate is off
    g.counters[2].enabled = True
    assert g.wrap(7, [4], rows=1, streaming=False) == [1, 3] and g.wrap(5, [4], rows=1, streaming=False) is None


@pytest.mark.parametrize("device", DEVICES)
def test_wrap_guesses_copy_the_first_layers_experts_and_keep_the_answers(device: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kw = dict(device=device, dtype="float32", max_num_batched_tokens=32)
    prompts = [[5, 6, 7, 8, 9], [11, 3, 2], [40, 41, 42, 43]]
    want = greedy_ids(LLM(**kw), prompts, 12)
    llm = LLM(moe_strategy="offload", expert_cache="10%", decode_misses="copy", **kw)  # guesses: the copy path
    experts = llm.engine.runner.experts
    first = experts.guesser.first
    calls: list[tuple[int, list[int]]] = []
    inner = experts.cache.prefetch

    def prefetch(layer: int, ids: list[int], *args, **kwargs) -> list[int]:  # noqa: ANN002, ANN003
        calls.append((layer, list(ids)))
        return inner(layer, ids, *args, **kwargs)

    monkeypatch.setattr(experts.cache, "prefetch", prefetch)
    assert greedy_ids(llm, prompts, 12) == want
    wraps = [ids for layer, ids in calls if layer == first]
    assert wraps, "no wrap guess was copied"
    c = experts.guesser.batch_counters[first]  # three sequences: graded as a batch
    assert c.fetched > 0 and 0 <= c.useful <= c.fetched
