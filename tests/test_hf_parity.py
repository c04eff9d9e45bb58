"""ferryman vs Hugging Face transformers (eager, fp32) on tiny random models of every architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferryman import LLM, SamplingParams
from tiny_models import ARCHS, build_tiny, hf_greedy, hf_logits

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]
PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33)), [(i * 37) % 250 + 3 for i in range(29)]]


@pytest.fixture(scope="module", params=ARCHS)
def tiny_with_ref(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, build_tiny(request.param, folder)


@pytest.mark.parametrize("device", DEVICES)
def test_logits_match_transformers(tiny_with_ref, device: str) -> None:
    arch, folder, ref = tiny_with_ref
    llm = LLM(str(folder), device=device, dtype="float32", enforce_eager=True)
    ours = llm.score(PROMPTS)  # one packed batch of different lengths
    for ids, got in zip(PROMPTS, ours):
        want = hf_logits(ref, ids)
        tol = 1e-4 * want.abs().max().item()
        err = (got.cpu() - want).abs().max().item()
        assert err <= tol, f"{arch}: max |logit diff| {err:.3g} > {tol:.3g} for a prompt of {len(ids)} tokens"


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_match_transformers(tiny_with_ref, device: str) -> None:
    arch, folder, ref = tiny_with_ref
    llm = LLM(str(folder), device=device, dtype="float32")
    # 20 tokens after prompts of 5 and 13: past the sliding windows (8, 12) and two KV blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=PROMPTS[:2], params=params)
    for ids, out in zip(PROMPTS[:2], outs):
        assert out.token_ids == hf_greedy(ref, ids, 20), f"{arch}: greedy tokens differ"
        assert out.finish_reason == "length"


@pytest.mark.parametrize("device", DEVICES)
def test_batched_equals_one_at_a_time(tiny_with_ref, device: str) -> None:
    """Chunked prefill mixed with decodes (16-token budget) gives the same tokens as solo runs."""
    arch, folder, _ = tiny_with_ref
    llm = LLM(str(folder), device=device, dtype="float32", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = PROMPTS + [[3, 4]]
    batched = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, params=params)]
    solo = [llm.generate(prompt_token_ids=[p], params=params)[0].token_ids for p in prompts]
    assert batched == solo, f"{arch}: batched generation differs from one-at-a-time"
    assert llm.stats()["steps"] > 0
