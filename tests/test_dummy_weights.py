"""load_format="dummy": random weights of the exact shapes and formats, reproducible, finite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ferryman import LLM, SamplingParams
from ferryman.weights.presets import get_preset


def _shrunk_preset(name: str, folder: Path, **overrides) -> Path:
    cfg = get_preset(name)
    cfg.update(overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_dummy_is_reproducible_and_seeded(tmp_path: Path) -> None:
    folder = _shrunk_preset("qwen3-30b-a3b", tmp_path / "q", num_hidden_layers=2, hidden_size=128,
                            moe_intermediate_size=64, num_experts=16, vocab_size=512, head_dim=32)
    ids = [[1, 2, 3, 4, 5, 6]]
    a = LLM(str(folder), device="cpu", load_format="dummy", seed=1).score(ids)[0]
    b = LLM(str(folder), device="cpu", load_format="dummy", seed=1).score(ids)[0]
    c = LLM(str(folder), device="cpu", load_format="dummy", seed=2).score(ids)[0]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.slow
def test_gpt_oss_dummy_has_real_shapes_mxfp4_and_finite_logits(tmp_path: Path) -> None:
    """Two real-width gpt-oss-20b layers (hidden 2880, MXFP4 experts of its shape; 8 of them, top-4)
    stay finite."""
    folder = _shrunk_preset("gpt-oss-20b", tmp_path / "g", num_hidden_layers=2, vocab_size=1024, num_local_experts=8,
                            layer_types=["sliding_attention", "full_attention"])
    llm = LLM(str(folder), device="cpu", load_format="dummy", max_model_len=256)
    banks = llm.engine.runner.model.moe_blocks()[0].experts.store.banks[0]
    assert banks["w13_blocks"].shape == (8, 5760, 90, 16) and banks["w13_blocks"].dtype == torch.uint8
    assert banks["w2_scales"].shape == (8, 2880, 90)
    logits = llm.score([list(range(1, 40))])[0]
    assert torch.isfinite(logits).all()
    assert logits.std() > 0


def test_preset_runs_with_dummy_by_name(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="--load-format dummy"):
        LLM("olmoe-1b-7b", device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "qwen3.5-397b-a17b"])
def test_hybrid_preset_dummy_runs_and_resumes(tmp_path: Path, name: str) -> None:
    """Four layers of a hybrid preset at its real hidden width (3 gated DeltaNet, 1 gated attention;
    16 narrowed experts): finite logits, and a second turn restored from a state checkpoint gives
    the tokens of a cold prefill."""
    folder = _shrunk_preset(name, tmp_path / "h", num_hidden_layers=4, num_experts=16, vocab_size=1024,
                            moe_intermediate_size=128, shared_expert_intermediate_size=128)
    kw = dict(device="cpu", load_format="dummy", max_model_len=256, max_num_seqs=2)
    llm = LLM(str(folder), **kw)
    assert len(llm.engine.runner.model.linear_layers()) == 3
    logits = llm.score([list(range(1, 40))])[0]
    assert torch.isfinite(logits).all() and logits.std() > 0
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[list(range(1, 40))], params=params)[0]
    turn2 = list(range(1, 40)) + first.token_ids + [7, 8, 9]
    warm = llm.generate(prompt_token_ids=[turn2], params=params)[0]
    cold = LLM(str(folder), enable_prefix_caching=False, **kw).generate(prompt_token_ids=[turn2], params=params)[0]
    assert warm.metrics.num_cached_tokens == 32 and warm.token_ids == cold.token_ids
