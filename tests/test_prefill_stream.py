"""Scan resistance of the expert cache under prefill streaming (ExpertCache.demote_fetched): with
near-uniform routing (random weights) every chunk touches every expert; once the cache is full,
what a chunk streams in must cycle through a window of slots, so the experts cached from one chunk
to the next stay and each chunk moves only the rest. Without it, LRFU on a cyclic scan flushes
the whole cache every chunk. These tests run chunk-major prefill (`prefill_mode="chunk"`); the
layer-major default streams each expert once per prompt (tests/test_layer_prefill.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from ferryman import LLM
from tiny_models import greedy_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # not an installed package
from bench_prefill_stream import UNIFORM as CONFIG, moved_per_chunk as _fetched_per_chunk  # noqa: E402

LAYERS, EXPERTS = CONFIG["num_hidden_layers"], CONFIG["num_experts"]


@pytest.fixture(scope="module")
def uniform_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("uniform")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return str(folder)


def test_chunks_keep_what_fits_beside_the_stream_window(uniform_model: str) -> None:
    chunk, total = 1024, LAYERS * EXPERTS
    llm = LLM(uniform_model, load_format="dummy", device="cpu", moe_strategy="offload", expert_cache="50%",
              max_num_batched_tokens=chunk, enforce_eager=True, prefill_mode="chunk")
    slots = llm.stats()["experts"]["slots"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 1000, (2 * chunk,), generator=gen).tolist() for _ in range(3)]
    _fetched_per_chunk(llm, prompts[0], chunk)  # cold cache: fills it
    window = 2 * EXPERTS  # the layer computing and the next one streaming in
    for prompt in prompts[1:]:
        # every expert is touched; only the ones outside the kept set move (LRFU alone: ~all 512)
        assert _fetched_per_chunk(llm, prompt, chunk) <= total - (slots - window) + 8


def test_every_layer_streams_the_same_share(uniform_model: str) -> None:
    """The experts kept from chunk to chunk are spread evenly over the layers (stream_quota), so
    every layer has copies to overlap with its neighbours' kernels (a cache that kept whole layers
    left the link idle while they computed)."""
    chunk = 1024
    llm = LLM(uniform_model, load_format="dummy", device="cpu", moe_strategy="offload", expert_cache="50%",
              max_num_batched_tokens=chunk, enforce_eager=True, prefill_mode="chunk")
    cache = llm.engine.runner.experts.cache
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 1000, (2 * chunk,), generator=gen).tolist() for _ in range(2)]
    _fetched_per_chunk(llm, prompts[0], chunk)  # cold cache: fills it
    c = cache.counters
    before = {layer: c.misses.get(layer, 0) + c.prefetch_fetched.get(layer, 0) for layer in cache.moe_index}
    _fetched_per_chunk(llm, prompts[1], chunk)
    moved = [c.misses.get(layer, 0) + c.prefetch_fetched.get(layer, 0) - before[layer] for layer in cache.moe_index]
    quota = cache.stream_quota()
    assert quota > 0
    share = 2 * (EXPERTS - quota)  # two chunks, each copying what the layer does not keep
    # the last layers may find a few of the previous chunk's stream still cached
    assert all(abs(m - share) <= 8 for m in moved), f"{moved} against {share}"


def test_a_chunks_inputs_go_through_the_transfer(uniform_model: str) -> None:
    """A prefill chunk's small inputs (slot ids) reach the device through Transfer.upload, which
    on CUDA queues them on the copy stream before the next layer's copies; a decode step's go on the
    compute stream. The tokens stay those of the resident model."""
    kw = dict(load_format="dummy", device="cpu", max_num_batched_tokens=256, enforce_eager=True)
    prompt = [list(range(7, 7 + 300))]
    want = greedy_ids(LLM(uniform_model, **kw), prompt, 4)
    llm = LLM(uniform_model, moe_strategy="offload", expert_cache="30%", prefill_mode="chunk", **kw)
    transfer = llm.engine.runner.experts.cache.transfer
    shapes: list[tuple[int, ...]] = []
    plain = transfer.upload

    def recorded(host: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(host.shape))
        return plain(host)

    transfer.upload = recorded
    assert greedy_ids(llm, prompt, 4) == want
    # 300 tokens in chunks of 256 and 44: one upload of [T, K] slot ids per MoE layer of each chunk;
    # then 3 decode steps of one token
    k = CONFIG["num_experts_per_tok"]
    assert sorted(set(shapes)) == [(44, k), (256, k)], shapes
    assert len(shapes) == 2 * LAYERS, len(shapes)


def test_stream_demotion_keeps_greedy_tokens(uniform_model: str) -> None:
    kw = dict(load_format="dummy", device="cpu", max_num_batched_tokens=256, enforce_eager=True)
    prompts = [list(range(7, 7 + 700)), [(i * 37) % 1000 + 3 for i in range(300)]]
    want = greedy_ids(LLM(uniform_model, **kw), prompts, 8)
    got = greedy_ids(LLM(uniform_model, moe_strategy="offload", expert_cache="30%", **kw), prompts, 8)
    assert got == want


def test_a_chunk_streams_the_next_layer_ahead(uniform_model: str) -> None:
    """At layer L a chunk's experts of L+1 start copying; the prefetched ones queue behind the
    demoted ones for eviction, so nearly every expert prefetched is still there when its layer
    runs, and tokens stay the same."""
    chunk = 1024
    llm = LLM(uniform_model, load_format="dummy", device="cpu", moe_strategy="offload", expert_cache="30%",
              max_num_batched_tokens=chunk, enforce_eager=True, prefill_mode="chunk")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 1000, (2 * chunk,), generator=gen).tolist() for _ in range(3)]
    _fetched_per_chunk(llm, prompts[0], chunk)  # cold cache
    s0 = llm.stats()["experts"]
    for prompt in prompts[1:]:
        _fetched_per_chunk(llm, prompt, chunk)
    s1 = llm.stats()["experts"]
    fetched = s1["prefetch_fetched"] - s0["prefetch_fetched"]
    # a few guesses name an expert the chunk's real routing never picks; the rest are used
    assert fetched > 0 and s1["prefetch_hits"] - s0["prefetch_hits"] >= 0.95 * fetched
    misses = s1["misses"] - s0["misses"]
    assert misses <= 0.2 * (misses + fetched)  # most of each chunk streams in ahead of its layer
    kw = dict(load_format="dummy", device="cpu", max_num_batched_tokens=256, enforce_eager=True)
    short = [list(range(7, 7 + 700))]
    assert greedy_ids(LLM(uniform_model, moe_strategy="offload", expert_cache="30%", **kw), short, 6) == \
        greedy_ids(LLM(uniform_model, **kw), short, 6)
