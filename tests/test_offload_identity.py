"""Offloaded experts compute what resident experts compute: greedy tokens with a 10% expert cache
equal the resident engine's (which test_hf_parity checks against transformers), on the tiny models
of every architecture (gpt-oss with MXFP4 experts) and on the bundled demo model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ferryman import LLM
from tiny_models import agree_but_near_ties, count_calls, greedy_ids, greedy_with_top2

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33)), [(i * 37) % 250 + 3 for i in range(29)], [3, 4]]
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("max_seqs, guessed", [(4, True), (1, False)])
def test_early_decode_guesses_only_small_batches(max_seqs: int, guessed: bool) -> None:
    """Decode steps of more than decode_max_seqs sequences make no early guess (a batch's union is
    most of the next layer); prefill chunks still stream."""
    llm = LLM(device="cpu", dtype="float32", moe_strategy="offload", expert_cache="10%", max_num_batched_tokens=32)
    guesser = llm.engine.runner.experts.guesser
    guesser.decode_max_seqs = max_seqs
    decode_sized = lambda layer, x, wide=False: 1 < x.shape[0] <= 3  # noqa: E731  (3 sequences x top-4 < 32 experts)
    batched = count_calls(guesser, "guess", decode_sized)
    greedy_ids(llm, [[5, 6, 7], [9, 10, 11, 12], [40, 41]], 6)
    assert (batched[0] > 0) == guessed, batched


def test_early_guess_batch_limit_default() -> None:
    """Decode guesses in steps of up to DECODE_MAX_SEQS (16) sequences; a set value wins; a bad one
    is refused; decode_prefetch=False turns decode guesses off (prefill still streams)."""
    from ferryman.experts.guesses import DECODE_MAX_SEQS, NextLayerGuesser

    gates = {0: torch.nn.Linear(4, 8), 1: torch.nn.Linear(4, 8)}
    assert NextLayerGuesser(gates, top_k=2).decode_max_seqs == DECODE_MAX_SEQS == 16
    assert NextLayerGuesser(gates, top_k=2, decode_max_seqs=7).decode_max_seqs == 7
    with pytest.raises(ValueError, match="decode_max_seqs >= 1"):
        NextLayerGuesser(gates, top_k=2, decode_max_seqs=0)
    off = NextLayerGuesser(gates, top_k=2, decode=False)
    assert not off.wants_prefetch(1, False, seqs=1) and off.wants_prefetch(1, True)


def test_one_sequence_offload_copies_at_most_the_narrow_width() -> None:
    """On the demo model (top-4), one sequence: no full decode guess copies more than 2 experts per
    layer step while the tails are not precise (the plans say so), and the tokens are the resident
    ones."""
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=32)
    want = greedy_ids(LLM(**kw), [[5, 6, 7]], 12)
    llm = LLM(moe_strategy="offload", expert_cache="10%", **kw)
    guesser = llm.engine.runner.experts.guesser
    guesser.tail_bar = 2.0  # never precise enough: the width stays narrow
    experts, plans = llm.engine.runner.experts, []
    route = experts.route

    def keep(*args: Any) -> Any:
        out = route(*args)
        plans.append(out[0])
        return out

    experts.route = keep  # type: ignore[method-assign]
    assert greedy_ids(llm, [[5, 6, 7]], 12) == want
    full = [p for plan in plans if plan.rows == 1 for p in plan.prefetch if p.kind == "full"]
    assert full and max(len(p.experts) for p in full) <= 2, full
    assert all(len(p.experts) + len(p.tail or ()) == len(p.guessed) for p in full)
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
    # 2 slots (prefill chunks run in rounds); under a device budget the shared region keeps at
    # least top_k slots (planner: PlanRequest.slot_floor)
    asked = max(1, round(0.1 * total))
    assert st["slots"] in (asked, max(asked, offload.engine.cfg.top_k))
    assert st["misses"] > 0 and st["evictions"] > 0, f"{arch}: a 10% cache must miss and evict: {st}"
    assert st["bytes_h2d"] == (st["misses"] + st["prefetch_fetched"]) * _payload_bytes(offload)


def _payload_bytes(llm: LLM) -> int:
    """Bytes copied per expert: its row of the expert-major pool."""
    return llm.engine.runner.experts.cache.pool.layout.row_bytes


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
def test_demo_model_offload_10pct_equals_resident(dtype: str) -> None:
    """fp32: the same tokens. bf16: a prefill chunk whose experts outnumber the free slots runs in
    rounds, which sums the experts in another order, so runs may part only at a rounding tie."""
    prompts = ["def quicksort(xs):", "import os\nimport sys\n\n\nclass ", "    for i in range(", "# "]
    kw = dict(device="cpu", dtype=dtype, max_num_batched_tokens=32)
    resident = LLM(**kw)
    ids = [resident.encode(p) for p in prompts]
    offload = LLM(moe_strategy="offload", expert_cache="10%", **kw)
    if dtype == "float32":
        assert greedy_ids(offload, ids, 24) == greedy_ids(resident, ids, 24)
    else:
        agree_but_near_ties(greedy_with_top2(offload, ids, 24), greedy_with_top2(resident, ids, 24), tie=0.15)
    st = offload.stats()["experts"]
    assert st["slots"] == 32 and st["hits"] > 0 and st["misses"] > 0
    assert 0 <= st["guess_recall"] <= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [dict(policy="lru", prefetch=False), dict(policy="lrfu", decode_prefetch=True)])
def test_demo_model_every_policy_and_layout_equals_resident(device: str, options: dict) -> None:
    """Policies and prefetch change what is copied when, never the answer."""
    kw = dict(device=device, dtype="float32", max_num_batched_tokens=32, enforce_eager=True)
    resident = LLM(**kw)
    ids = [resident.encode(p) for p in ("def quicksort(xs):", "class Stack:\n    def")]
    offload = LLM(moe_strategy="offload", expert_cache=24, **kw)
    backend = offload.engine.runner.rebind_experts(**options)
    assert backend.cache.table.policy.name == options["policy"]
    assert greedy_ids(offload, ids, 32) == greedy_ids(resident, ids, 32)
    st = offload.stats()["experts"]
    assert st["misses"] > 0 and (st["prefetch_fetched"] == 0) == (options.get("prefetch") is False)


@pytest.mark.gpu
def test_cuda_copy_stream_never_races_the_kernels() -> None:
    """Two slots for 320 experts: every layer evicts what the previous one read while its kernels
    may still run, and prefetches land behind misses. Any missing event wait shows up as a
    different token."""
    kw = dict(device="cuda", dtype="float32", enforce_eager=True)
    resident = LLM(**kw)
    ids = [resident.encode("import os\nimport sys\n\ndef main(")]
    offload = LLM(moe_strategy="offload", expert_cache=2, **kw)
    assert greedy_ids(offload, ids * 3, 48) == greedy_ids(resident, ids * 3, 48)
    st = offload.stats()["experts"]
    assert st["host_pinned"] and st["h2d_seconds"] > 0 and st["stall_seconds"] >= 0
