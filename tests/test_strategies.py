"""The MoE strategies (`moe_strategy`, experts/placement.py): the plan each makes (planner_split.py
`cpu_split`: layers:N and the N that fills the budget, cpu's floor of slots), and greedy tokens
identical to the resident engine's (which test_hf_parity checks against transformers) for offload,
hybrid, cpu and layers on the tiny models of every architecture and on the demo model (CPU, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferryman import LLM
from ferryman.calibrate.calibration import save
from ferryman.config import ModelConfig, parse_bytes, parse_strategy
from ferryman.errors import ConfigError
from ferryman.experts import hybrid as hybrid_module
from ferryman.models.registry import model_config
from ferryman.planner import PlanRequest
from ferryman.planner_search import plan_memory
from ferryman.weights.presets import get_preset
from tiny_models import calibration_of, demo_config, greedy_ids

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33)), [(i * 37) % 250 + 3 for i in range(29)], [3, 4]]


def _plan(strategy: str, budget: str | None, expert_cache: int | None = None) -> tuple[ModelConfig, object]:
    cfg = model_config(dict(get_preset("gpt-oss-20b")))
    req = PlanRequest(cfg, torch.bfloat16, None if budget is None else parse_bytes(budget), 4096, 1,
                      strategy=strategy, expert_cache=expert_cache)
    return cfg, plan_memory(req)


def test_parse_strategy() -> None:
    assert parse_strategy("layers") == ("layers", None) and parse_strategy("layers:7") == ("layers", 7)
    assert parse_strategy("hybrid") == ("hybrid", None)
    for bad in ("layers:", "layers:-1", "cpu:3", "gpu"):
        with pytest.raises(ConfigError, match="moe_strategy"):
            parse_strategy(bad)


def test_layers_fills_the_budget_with_whole_layers() -> None:
    """layers without N: the experts' share of the budget as whole layers on the device (what
    offload would give its cache at start, rounded down to layers: offload's shared region rounds
    to pages, so one layer more or less), the first N = the rest on the CPU."""
    cfg, offload = _plan("offload", "8GiB")
    _, layers = _plan("layers", "8GiB")
    per_layer = cfg.num_experts
    on_device = layers.expert_slots // per_layer
    assert layers.strategy == "offload" and layers.expert_slots == on_device * per_layer
    assert abs(on_device - offload.expert_slots // per_layer) <= 1
    assert layers.cpu_layers == len(cfg.moe_layers) - on_device > 0
    assert layers.kv_tokens >= layers.request.kv_floor_tokens  # the partial layer's bytes go to KV


def test_layers_n_and_cpu_plans() -> None:
    cfg, fixed = _plan("layers:20", "8GiB")
    assert fixed.cpu_layers == 20 and fixed.expert_slots == (len(cfg.moe_layers) - 20) * cfg.num_experts
    _, cpu = _plan("cpu", "8GiB")
    assert cpu.cpu_layers == len(cfg.moe_layers) and cpu.expert_slots == cfg.top_k
    _, unlimited = _plan("layers:3", None)
    assert unlimited.cpu_layers == 3
    with pytest.raises(ConfigError, match="the model has 24 MoE layers"):
        _plan("layers:30", "8GiB")
    with pytest.raises(ConfigError, match="missing"):  # 4 layers on the CPU leave too many for 8 GiB
        _plan("layers:4", "8GiB")


def _strategies(tmp_path: Path, cfg: ModelConfig) -> dict[str, dict]:
    path = tmp_path / "cal.json"
    save(calibration_of(cfg, torch.float32, 1000.0, 3000.0), path)
    return {"offload": dict(moe_strategy="offload", expert_cache="10%"),
            "hybrid": dict(moe_strategy="hybrid", expert_cache="10%", calibration=str(path)),
            "cpu": dict(moe_strategy="cpu"),
            "layers": dict(moe_strategy="layers:2", expert_cache="50%")}


@pytest.mark.parametrize("name", ["offload", "hybrid", "cpu", "layers"])
def test_tiny_models_strategies_equal_resident(tiny: tuple[str, Path], name: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    arch, folder = tiny
    monkeypatch.setattr(hybrid_module, "MIN_CPU", 1)  # the tiny models miss one or two experts per step
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=16, max_num_seqs=2, enforce_eager=True)
    want = greedy_ids(LLM(str(folder), **kw), PROMPTS, 12)
    llm = LLM(str(folder), **_strategies(tmp_path, model_config(folder))[name], **kw)
    assert greedy_ids(llm, PROMPTS, 12) == want, f"{arch}: {name} greedy tokens differ from resident"
    st = llm.stats()["experts"]
    if name in ("hybrid", "cpu", "layers"):
        assert st["cpu_computed"] > 0, st
    if name == "cpu":
        assert st["misses"] == 0 and st["hits"] == 0, st  # no layer reads the device's slots


@pytest.mark.parametrize("name", ["offload", "hybrid", "cpu", "layers"])
def test_demo_model_strategies_equal_resident(name: str, tmp_path: Path) -> None:
    prompts = ["def quicksort(xs):", "import os\nimport sys\n\n\nclass ", "    for i in range("]
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=32)
    resident = LLM(**kw)
    ids = [resident.encode(p) for p in prompts]
    llm = LLM(**_strategies(tmp_path, demo_config())[name], **kw)
    assert greedy_ids(llm, ids, 24) == greedy_ids(resident, ids, 24)
    assert llm.stats()["moe_strategy"] == "offload"  # the memory plan's: host RAM + slots


@pytest.mark.parametrize("seed", range(20))
def test_split_ends_both_paths_within_one_expert(seed: int) -> None:
    """The split's cost model on synthetic rates: fetching F misses (F / r_link) and computing the
    others on the CPU (their summed costs) end within one expert's time of each other, unless every
    miss goes one way (then moving one more would make that side end later)."""
    from ferryman.experts.hybrid import split_costs

    gen = torch.Generator().manual_seed(seed)
    r_link = float(torch.randint(500, 5000, (1,), generator=gen))
    costs = [float(c) for c in torch.rand(int(torch.randint(1, 40, (1,), generator=gen)), generator=gen) * 2e-3 + 1e-4]
    f = split_costs(costs, r_link)
    link, cpu = f / r_link, sum(costs[f:])
    one = max(1.0 / r_link, max(costs))
    if 0 < f < len(costs):
        assert abs(link - cpu) <= one + 1e-12, (f, link, cpu, one)
    elif f == 0:
        assert cpu <= 1.0 / r_link + 1e-12  # fetching the first would end later than the CPU's all
    else:
        assert link <= costs[-1] + 1e-12  # computing the last on the CPU would end no sooner


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hybrid", "cpu", "layers"])
def test_cuda_strategies_equal_resident(name: str, tmp_path: Path) -> None:
    """On CUDA the CPU's layers and misses run in the worker thread beside the device (the
    per-layer decode graphs wait for the CPU's part); fp32, so the tokens are the resident ones."""
    kw = dict(device="cuda", dtype="float32", max_num_batched_tokens=32)
    resident = LLM(**kw)
    ids = [resident.encode(p) for p in ("def quicksort(xs):", "class Stack:\n    def")]
    opts = _strategies(tmp_path, demo_config())[name]
    if name == "hybrid":  # on CUDA the split reads the link's rate from h2d
        import dataclasses

        cal = calibration_of(demo_config(), torch.float32, 1000.0, 1000.0)
        save(dataclasses.replace(cal, h2d=cal.host_copy), tmp_path / "cal.json")
    llm = LLM(**opts, **kw)
    assert llm.engine.runner.experts.cpu.pool is not None
    assert greedy_ids(llm, ids, 24) == greedy_ids(resident, ids, 24)
    assert llm.stats()["experts"]["cpu_computed"] > 0
