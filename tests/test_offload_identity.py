"""Offloaded experts compute what resident experts compute: greedy tokens with a 10% expert cache
equal the resident engine's (which test_hf_parity checks against transformers), on the tiny models
of every architecture (gpt-oss with MXFP4 experts) and on the bundled demo model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ferryman import LLM
from tiny_models import count_calls, greedy_ids

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33)), [(i * 37) % 250 + 3 for i in range(29)], [3, 4]]
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("max_seqs, guessed", [(4, True), (1, False)])
def test_early_decode_guesses_only_small_batches(max_seqs: int, guessed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """FERRYMAN_DECODE_PREFETCH_MAX_SEQS: decode steps of more sequences make no early guess (a
    batch's union is most of the next layer); prefill chunks still stream."""
    monkeypatch.setenv("FERRYMAN_DECODE_PREFETCH", "early")
    monkeypatch.setenv("FERRYMAN_DECODE_PREFETCH_MAX_SEQS", str(max_seqs))
    llm = LLM(device="cpu", dtype="float32", moe_strategy="offload", expert_cache="10%", max_num_batched_tokens=32)
    guesser = llm.engine.runner.experts.guesser
    decode_sized = lambda layer, x, wide=False: 1 < x.shape[0] <= 3  # noqa: E731  (3 sequences x top-4 < 32 experts)
    batched = count_calls(guesser, "guess", decode_sized)
    greedy_ids(llm, [[5, 6, 7], [9, 10, 11, 12], [40, 41]], 6)
    assert (batched[0] > 0) == guessed, batched


def test_early_guess_batch_limit_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """FERRYMAN_DECODE_PREFETCH_MAX_SEQS=0 (default): 16 sequences; a set value wins; a negative one
    is a clean configuration error."""
    from ferryman.errors import ConfigError
    from ferryman.experts.prefetch import DECODE_MAX_SEQS, NextLayerGuesser

    gates = {0: torch.nn.Linear(4, 8), 1: torch.nn.Linear(4, 8)}
    assert NextLayerGuesser(gates, top_k=2).decode_max_seqs == DECODE_MAX_SEQS
    assert NextLayerGuesser(gates, top_k=2, decode_max_seqs=7).decode_max_seqs == 7
    with pytest.raises(ConfigError, match="FERRYMAN_DECODE_PREFETCH_MAX_SEQS must be >= 0"):
        NextLayerGuesser(gates, top_k=2, decode_max_seqs=-1)
    llm = LLM(device="cpu", dtype="float32", moe_strategy="offload", expert_cache="10%")
    assert llm.engine.runner.experts.guesser.decode_max_seqs == 16
    monkeypatch.setenv("FERRYMAN_DECODE_PREFETCH_MAX_SEQS", "-2")
    with pytest.raises(ConfigError, match="got -2"):
        LLM(device="cpu", dtype="float32", moe_strategy="offload", expert_cache="10%")


def test_wider_early_guesses_recall_more_and_keep_the_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """FERRYMAN_DECODE_PREFETCH_TOPK and _SOLO_TOPK at 6 on a top-4 model: each decode guess is a
    superset of the default top-4 one from the same input, so recall can only rise; answers stay
    the resident ones."""
    monkeypatch.setenv("FERRYMAN_DECODE_PREFETCH", "early")
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=32)
    want = greedy_ids(LLM(**kw), prompts, 12)
    recall = {}
    for k in (0, 6):
        monkeypatch.setenv("FERRYMAN_DECODE_PREFETCH_TOPK", str(k))
        monkeypatch.setenv("FERRYMAN_DECODE_PREFETCH_SOLO_TOPK", str(k))
        llm = LLM(moe_strategy="offload", expert_cache="10%", **kw)
        guesser = llm.engine.runner.experts.guesser
        assert (guesser.width(1), guesser.width(2), guesser.copy_width(1)) == ((6, 6, 6) if k else (4, 4, 2))
        assert greedy_ids(llm, prompts, 12) == want
        recall[k] = llm.stats()["experts"]["guess_recall"]
    assert recall[6] > recall[0], recall
    for name in ("FERRYMAN_DECODE_PREFETCH_TOPK", "FERRYMAN_DECODE_PREFETCH_SOLO_TOPK"):
        monkeypatch.setenv(name, "-1")
        with pytest.raises(ValueError, match=name):
            LLM(moe_strategy="offload", expert_cache="10%", **kw)
        monkeypatch.setenv(name, "0")


def test_one_sequence_offload_copies_at_most_the_narrow_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the demo model (top-4), one sequence: no decode guess copies more than 2 experts per
    layer step while the tails are not precise, and the tokens are the resident ones."""
    monkeypatch.setenv("FERRYMAN_DECODE_PREFETCH", "early")
    monkeypatch.setenv("FERRYMAN_DECODE_WRAP_GUESS", "0")  # a wrap guess copies what the first layer used
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=32)
    want = greedy_ids(LLM(**kw), [[5, 6, 7]], 12)
    llm = LLM(moe_strategy="offload", expert_cache="10%", **kw)
    guesser = llm.engine.runner.experts.guesser
    guesser.tail_bar = 2.0  # never precise enough: the width stays narrow
    experts, copied = llm.engine.runner.experts, []
    prefetch = experts.cache.prefetch

    def counted(layer: int, ids: list[int], *a: Any, streaming: bool = False) -> list[int]:
        if experts._step_seqs == 1:  # a one-token step: decode (the prompt's step has 3 rows)
            copied.append(len(ids))
        return prefetch(layer, ids, *a, streaming=streaming)

    monkeypatch.setattr(experts.cache, "prefetch", counted)
    assert greedy_ids(llm, [[5, 6, 7]], 12) == want
    assert copied and max(copied) <= 2, copied
    tails = [c.tail_guessed for c in guesser.counters.values()]
    assert sum(tails) > 0, "the uncopied tails were not graded"



@pytest.mark.parametrize("device", DEVICES)
def test_tiny_models_offload_10pct_equals_resident(tiny: tuple[str, Path], device: str) -> None:
    arch, folder = tiny
    kw = dict(device=device, dtype="float32", max_num_batched_tokens=16, enforce_eager=True)
    resident = LLM(str(folder), **kw)
    offload = LLM(str(folder), moe_strategy="offload", expert_cache="10%", **kw)
    want = greedy_ids(resident, PROMPTS, 16)
    got = greedy_ids(offload, PROMPTS, 16)
    assert got == want, f"{arch}: offloaded greedy tokens differ from resident"
    # on CUDA an offloaded plan keeps an untied token-embedding table in host RAM
    host_table = device == "cuda" and not offload.engine.cfg.tie_word_embeddings
    assert offload.engine.plan.host_embedding == (not offload.engine.cfg.tie_word_embeddings)
    assert (offload.engine.runner.model.embed_tokens.weight.device.type == "cpu") == (host_table or device == "cpu")
    st = offload.stats()["experts"]
    total = len(offload.engine.cfg.moe_layers) * offload.engine.cfg.num_experts
    assert st["slots"] == max(1, round(0.1 * total))  # 2 slots: prefill chunks run in rounds
    assert st["misses"] > 0 and st["evictions"] > 0, f"{arch}: a 10% cache must miss and evict: {st}"
    assert st["bytes_h2d"] == (st["misses"] + st["prefetch_fetched"]) * _payload_bytes(offload)


def _payload_bytes(llm: LLM) -> int:
    """Bytes copied per expert: its row (expert-major pool, the default) or its banks (bank-major)."""
    cache = llm.engine.runner.experts.cache
    if cache.pool.expert_major:
        return cache.pool.layout.row_bytes
    return sum(cache.pool.layout.sizes.values())


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_model_offload_scores_match_resident(tiny: tuple[str, Path], device: str) -> None:
    """Prefill logits (one packed batch) through a 10% cache: the same up to summation order."""
    arch, folder = tiny
    resident = LLM(str(folder), device=device, dtype="float32", enforce_eager=True)
    offload = LLM(str(folder), device=device, dtype="float32", moe_strategy="offload", expert_cache=2,
                  enforce_eager=True)
    for want, got in zip(resident.score(PROMPTS), offload.score(PROMPTS)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), arch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_model_offload_10pct_equals_resident(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRYMAN_DECODE_PREFETCH", "early")  # decode guesses act, and are graded
    prompts = ["def quicksort(xs):", "import os\nimport sys\n\n\nclass ", "    for i in range(", "# "]
    kw = dict(device="cpu", dtype=dtype, max_num_batched_tokens=32)
    resident = LLM(**kw)
    ids = [resident.encode(p) for p in prompts]
    offload = LLM(moe_strategy="offload", expert_cache="10%", **kw)
    assert greedy_ids(offload, ids, 40) == greedy_ids(resident, ids, 40)
    st = offload.stats()["experts"]
    assert st["slots"] == 32 and st["hits"] > 0 and st["misses"] > 0
    assert 0 <= st["guess_recall"] <= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [dict(policy="lru", prefetch=False), dict(policy="lrfu", expert_major=False, decode_prefetch="early")])
def test_demo_model_every_policy_and_layout_equals_resident(device: str, options: dict) -> None:
    """Policies, pool layouts and prefetch change what is copied when, never the answer. On CUDA the
    bank-major pool runs fused_moe's kernels, the expert-major one the same decode kernel on strided
    banks and grouped_moe for prefill chunks."""
    from ferryman.experts.placement import rebind_offload

    kw = dict(device=device, dtype="float32", max_num_batched_tokens=32, enforce_eager=True)
    resident = LLM(**kw)
    ids = [resident.encode(p) for p in ("def quicksort(xs):", "class Stack:\n    def")]
    offload = LLM(moe_strategy="offload", expert_cache=24, **kw)
    backend = rebind_offload(offload.engine.runner, **options)
    assert backend.cache.table.policy.name == options["policy"]
    assert greedy_ids(offload, ids, 32) == greedy_ids(resident, ids, 32)
    st = offload.stats()["experts"]
    assert st["misses"] > 0 and (st["prefetch_fetched"] == 0) == (options.get("prefetch") is False)


@pytest.mark.gpu
@pytest.mark.parametrize("expert_major", [False, True])
def test_cuda_copy_stream_never_races_the_kernels(expert_major: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two slots for 320 experts: every layer evicts what the previous one read while its kernels
    may still run, and prefetches land behind misses. Any missing event wait shows up as a
    different token."""
    from ferryman.experts.placement import rebind_offload

    monkeypatch.setenv("FERRYMAN_DECODE_PREFETCH", "early")
    kw = dict(device="cuda", dtype="float32", enforce_eager=True)
    resident = LLM(**kw)
    ids = [resident.encode("import os\nimport sys\n\ndef main(")]
    offload = LLM(moe_strategy="offload", expert_cache=2, **kw)
    rebind_offload(offload.engine.runner, expert_major=expert_major)
    assert greedy_ids(offload, ids * 3, 48) == greedy_ids(resident, ids * 3, 48)
    st = offload.stats()["experts"]
    assert st["host_pinned"] and st["h2d_seconds"] > 0 and st["stall_seconds"] >= 0
