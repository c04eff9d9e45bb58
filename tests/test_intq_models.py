"""Tiny qwen3_moe and mixtral checkpoints written in each integer layout (tests/int_checkpoints.py):
ferryman's greedy tokens equal transformers' on the same weights dequantised to fp32 (a plain
safetensors folder), CPU; every decoder linear is packed, so the dense layers' dequantisation at
load is checked too. And dummy int4 weights: packed banks of the planned size that run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from int_checkpoints import LAYOUTS, write_int_checkpoint
from tiny_models import COMMON, CONFIGS, build_tiny, hf_greedy

from ferryman import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33))]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def tiny_src(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    build_tiny(request.param, folder)
    return request.param, folder


CASES = [pytest.param(layout, "cpu", id=layout) for layout in LAYOUTS] + [
    pytest.param(layout, "cuda", id=f"{layout}-cuda", marks=pytest.mark.gpu)  # the Triton kernels: decode, prefill
    for layout in ("ct_int4_asym", "ct_int8_channel", "gptq_desc_act")]


@pytest.mark.parametrize("layout, device", CASES)
def test_greedy_tokens_match_transformers_on_dequantised_weights(tiny_src, layout: str, device: str,
                                                                  tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    arch, src = tiny_src
    write_int_checkpoint(src, layout, tmp_path / "packed", tmp_path / "ref")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32,
                                               attn_implementation="eager").eval()
    llm = LLM(str(tmp_path / "packed"), device=device, dtype="float32")
    fmt = llm.engine.cfg.expert_format
    assert fmt.startswith(("int4:", "int8:")), fmt
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for ids, out in zip(PROMPTS, llm.generate(prompt_token_ids=PROMPTS, params=params)):
        assert out.token_ids == hf_greedy(ref, ids, 12), f"{arch} {layout} ({fmt}): greedy tokens differ"


def test_dummy_int4_weights_are_packed_and_run(tmp_path: Path) -> None:
    """--quantization int4 on a model without weights: experts in int4:g128:sym banks (packed bytes
    in the store and the plan), dense layers as they were, finite logits."""
    import json

    from ferryman.quant import get_format

    cfg = {**COMMON, **CONFIGS["qwen3_moe"], "hidden_size": 128, "moe_intermediate_size": 128,
           "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", load_format="dummy", quantization="int4")
    assert llm.engine.cfg.expert_format == "int4:g128:sym"
    fmt = get_format("int4:g128:sym")
    dense = get_format("dense").expert_bytes(128, 128, False, torch.bfloat16)
    assert fmt.expert_bytes(128, 128, False, torch.bfloat16) < dense / 3
    logits = llm.score([[1, 2, 3, 4]])[0]
    assert torch.isfinite(logits).all()
