"""glm4_moe beyond the shared parity suites (test_hf_parity, test_offload_identity): MTP layers in a
checkpoint are skipped and named, sigmoid routers stay fp32 in a bf16 model, the planner's bytes
are the module tree's, partial rotary defaults to 0.5, a shrunk real-width preset runs on dummy
weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferryman import LLM
from ferryman.cli import main
from ferryman.layers.moe import SparseMoE
from ferryman.models.registry import model_config
from ferryman.models.transformer import MoETransformer
from ferryman.planner import non_expert_bytes
from ferryman.weights.presets import get_preset
from tiny_models import build_tiny, hf_greedy

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33))]


@pytest.fixture(scope="module")
def tiny_with_mtp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """The tiny glm4_moe with an MTP layer's tensors stored as layer 3 (num_hidden_layers = 3)."""
    folder = tmp_path_factory.mktemp("glm4_moe_mtp")
    ref = build_tiny("glm4_moe", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    mtp["model.layers.3.enorm.weight"] = torch.ones(64)
    mtp["model.layers.3.shared_head.norm.weight"] = torch.ones(64)
    save_file({**tensors, **mtp}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    return folder, ref


def test_mtp_layer_is_skipped_at_load_and_named_by_info(tiny_with_mtp, capsys: pytest.CaptureFixture) -> None:
    folder, ref = tiny_with_mtp
    llm = LLM(str(folder), device="cpu", dtype="float32")
    assert llm.engine.cfg.num_mtp_layers == 1 and len(llm.engine.runner.model.layers) == 3
    outs = llm.generate(prompt_token_ids=PROMPTS, params=_greedy(12))
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, 12) for p in PROMPTS]
    assert main(["info", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "1 MTP layer(s): model.layers.3.*" in out and "3 (2 MoE, 1 dense)" in out
    assert "shared experts FFN 32 (resident)" in out and "top-2 of 4 groups" in out


def _greedy(n: int):  # noqa: ANN202
    from ferryman import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _shrunk(name: str, **overrides) -> dict:
    return {**get_preset(name), "num_hidden_layers": 4, "vocab_size": 512, **overrides}


@pytest.mark.parametrize("name", ["glm-4.5", "glm-4.5-air"])
def test_planner_bytes_are_the_module_tree_bytes(name: str) -> None:
    """Shared experts, dense layers and the fp32 sigmoid router, counted as the bf16 model holds them."""
    cfg = model_config(_shrunk(name))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            net = MoETransformer(cfg, 16)
    finally:
        torch.set_default_dtype(previous)
    blocks = [m for m in net.modules() if isinstance(m, SparseMoE)]
    assert len(blocks) == len(cfg.moe_layers) and blocks and all(b.shared_experts is not None for b in blocks)
    assert all(p.dtype == torch.float32 for b in blocks for p in b.gate.parameters())
    held = sum(p.numel() * p.element_size() for p in net.parameters())
    assert non_expert_bytes(cfg, torch.bfloat16) == held


def test_config_reading() -> None:
    cfg = model_config(get_preset("glm-4.5"))
    assert cfg.dense_layers == (0, 1, 2) and cfg.qk_norm == "head" and cfg.rope.partial_rotary_factor == 0.5
    assert cfg.attention_bias and not cfg.attention_out_bias and cfg.shared_intermediate_size == 1536
    assert (cfg.router_kind, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == ("sigmoid", 1, 1, 2.5)
    silent = {k: v for k, v in get_preset("glm-4.5-air").items() if k != "partial_rotary_factor"}
    assert model_config(silent).rope.partial_rotary_factor == 0.5  # transformers' Glm4MoeConfig default
    assert model_config({**silent, "partial_rotary_factor": 1.0}).rope.partial_rotary_factor == 1.0
    assert model_config(get_preset("glm-4.5-air")).qk_norm == "none"


@pytest.mark.parametrize("bad, match", [({"n_group": 3}, "n_group 3 must divide"),
                                        ({"n_group": 4, "topk_group": 5}, "topk_group 5 is not in 1..n_group"),
                                        ({"n_group": 64, "topk_group": 1}, "exceeds the experts")])
def test_bad_group_settings_are_named(bad: dict, match: str) -> None:
    from ferryman.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        model_config({**get_preset("glm-4.5-air"), **bad})


def test_shrunk_air_runs_on_dummy_weights(tmp_path: Path) -> None:
    """Real widths of GLM-4.5-Air (hidden 4096, 96 heads of 128, experts of 1408) over 2 layers, one dense."""
    folder = tmp_path / "air"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_shrunk("glm-4.5-air", num_hidden_layers=2, n_routed_experts=16)))
    llm = LLM(str(folder), device="cpu", load_format="dummy", max_model_len=64, moe_strategy="offload",
              expert_cache=4)
    logits = llm.score([list(range(1, 20))])[0]
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_activations_count_the_shared_experts() -> None:
    """A prefill chunk's shared-expert gate_up / activation ([2S] + [S] per token) are planned for."""
    from dataclasses import replace

    from ferryman.planner import activation_bytes

    cfg = model_config(get_preset("glm-4.5"))
    without = replace(cfg, shared_intermediate_size=0)
    got = activation_bytes(cfg, torch.bfloat16, 4096, 1) - activation_bytes(without, torch.bfloat16, 4096, 1)
    assert got == 4096 * 2 * 3 * 1536
