"""DeepSeek-V3 / Kimi-K2 end to end on a tiny random checkpoint (tiny_models.py's deepseek_v3: MLA
with a q LoRA pair, grouped sigmoid routing with a random correction bias, a shared expert, a dense
first layer): long prompts over several KV blocks against transformers, the latent KV cache's size,
the kimi_k2 model_type, and MTP tensors left unloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferryman import LLM, SamplingParams
from ferryman.models.registry import model_config
from ferryman.planner import kv_bytes_per_token
from ferryman.weights.presets import get_preset
from tiny_models import build_tiny, greedy_ids, hf_greedy

# 45 and 38 prompt tokens + 24 decoded: 5 blocks of 16 each, prefilled in chunks of 16
LONG = [[(i * 53) % 250 + 3 for i in range(45)], [(i * 31 + 7) % 250 + 3 for i in range(38)]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("deepseek_v3")
    return folder, build_tiny("deepseek_v3", folder)


def test_long_prompts_chunked_match_transformers(tiny: tuple[Path, torch.nn.Module]) -> None:
    folder, ref = tiny
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=16, enforce_eager=True)
    got = greedy_ids(llm, LONG, 24)
    for ids, tokens in zip(LONG, got):
        assert tokens == hf_greedy(ref, ids, 24)


def test_kv_cache_holds_the_latent_only(tiny: tuple[Path, torch.nn.Module]) -> None:
    """Per token and layer: kv_lora_rank + qk_rope_head_dim values (32 + 8), one tensor per layer."""
    folder, _ = tiny
    llm = LLM(str(folder), dtype="float32", kv_cache_tokens=512)
    cfg = llm.engine.cfg
    attn = llm.engine.runner.model.attention_layers()
    assert all(a.v_cache is None and tuple(a.k_cache.shape[1:]) == (16, 1, 40) for a in attn)
    assert kv_bytes_per_token(cfg, torch.float32) == 3 * 40 * 4
    assert llm.engine.memory_usage()["kv_cache"] == 512 * kv_bytes_per_token(cfg, torch.float32)


def test_preset_kv_bytes_per_token() -> None:
    """DeepSeek-V3: 61 layers x (512 + 64) bf16 values = 70,272 bytes per token (full K/V of 128 heads
    would be 61 x 2 x 128 x 192 x 2 bytes, 43x more)."""
    cfg = model_config(get_preset("deepseek-v3"))
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 61 * 576 * 2
    assert cfg.mla is not None and cfg.mla.softmax_scale == pytest.approx(
        192**-0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)


def test_kimi_k2_model_type_runs_the_same_model(tiny: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    folder, ref = tiny
    kimi = tmp_path / "kimi"
    shutil.copytree(folder, kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"
    (kimi / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(kimi), dtype="float32")
    assert llm.engine.cfg.model_type == "kimi_k2"
    assert greedy_ids(llm, LONG[:1], 8)[0] == hf_greedy(ref, LONG[0], 8)


def test_mtp_layer_is_not_loaded(tiny: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    """A checkpoint with one multi-token-prediction layer after the last (model.layers.3.*, as
    DeepSeek-V3 ships model.layers.61.*) loads and decodes as without it."""
    folder, ref = tiny
    mtp = tmp_path / "mtp"
    shutil.copytree(folder, mtp)
    (file,) = mtp.glob("*.safetensors")
    tensors = load_file(str(file))
    extra = {k.replace("model.layers.2.", "model.layers.3."): torch.randn(v.shape) for k, v in tensors.items()
             if k.startswith("model.layers.2.")}
    extra["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    save_file({**tensors, **extra}, str(file), metadata={"format": "pt"})
    cfg = json.loads((mtp / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (mtp / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(mtp), dtype="float32")
    assert llm.engine.cfg.num_mtp_layers == 1 and llm.engine.cfg.num_layers == 3
    assert greedy_ids(llm, LONG[1:], 8)[0] == hf_greedy(ref, LONG[1], 8)


@pytest.mark.gpu
def test_cuda_decode_matches_transformers(tiny: tuple[Path, torch.nn.Module]) -> None:
    """The CUDA path (Triton latent decode, CUDA graphs) in fp32 gives transformers' greedy tokens."""
    folder, ref = tiny
    llm = LLM(str(folder), device="cuda", dtype="float32", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=LONG, params=params)
    for ids, out in zip(LONG, outs):
        assert out.token_ids == hf_greedy(ref, ids, 24)


def test_config_without_mla_fields_is_refused_by_name() -> None:
    from ferryman.errors import ConfigError

    cfg = get_preset("kimi-k2")
    del cfg["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kimi_k2 model lacks kv_lora_rank"):
        model_config(cfg)
