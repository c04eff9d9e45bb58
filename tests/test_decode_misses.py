"""The planner's choice of how offloaded decode reaches uncached experts (planner.plan_decode_misses):
link reads where the experts' format reads well over the link and every MoE layer is on the GPU
path, copies elsewhere; a forced `link` it cannot run is refused by name; `ferryman plan` and its
prediction follow the choice."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ferryman.config import ModelConfig, parse_bytes
from ferryman.errors import ConfigError
from ferryman.models.registry import model_config
from ferryman.plan_report import Load, Rates, describe_plan, predict
from ferryman.planner import PlanRequest, link_step_fits, plan_decode_misses
from ferryman.planner_search import plan_memory
from ferryman.quant import get_format
from ferryman.weights.presets import get_preset


def _cfg(name: str, fmt: str | None = None) -> ModelConfig:
    cfg = model_config(dict(get_preset(name)))  # per-layer formats name every MoE layer's
    return cfg if fmt is None else replace(cfg, expert_formats=tuple(fmt if i in cfg.moe_layers else ""
                                                                     for i in range(cfg.num_layers)))


def _plan(cfg: ModelConfig, budget: str | None = "8GiB", **kw: object):
    args = dict(max_model_len=4096, max_num_seqs=1, kernels="triton")
    args.update(kw)
    return plan_memory(PlanRequest(cfg, torch.bfloat16, None if budget is None else parse_bytes(budget), **args))


@pytest.mark.parametrize("fmt,reads", [("dense", True), ("fp8:128x128", True), ("int4:g128:sym", True),
                                       ("gguf:q4_k:q6_k", True), ("gguf:iq4_xs:q8_0", True), ("mxfp4", False),
                                       ("nvfp4", False), ("gguf:mxfp4:mxfp4", False), ("gguf:q4_k:mxfp4", False)])
def test_formats_say_whether_they_read_well_over_the_link(fmt: str, reads: bool) -> None:
    assert get_format(fmt).link_reads is reads


@pytest.mark.parametrize("fmt,want", [("dense", "link"), ("fp8:128x128", "link"), ("int4:g128:sym", "link"),
                                      ("gguf:q4_k:q6_k", "link"), ("mxfp4", "copy")])
def test_auto_reads_over_the_link_where_the_format_allows(fmt: str, want: str) -> None:
    plan = _plan(_cfg("qwen3-30b-a3b", fmt))
    assert plan.strategy == "offload" and plan.decode_misses == want


def test_one_slow_layer_format_keeps_the_copy_path() -> None:
    cfg = _cfg("qwen3-30b-a3b")
    mixed = tuple("mxfp4" if i == cfg.moe_layers[-1] else "gguf:q4_k:q6_k" for i in range(cfg.num_layers))
    assert _plan(replace(cfg, expert_formats=mixed)).decode_misses == "copy"


@pytest.mark.parametrize("strategy", ["hybrid", "cpu", "layers", "layers:46"])
def test_strategies_with_cpu_work_copy(strategy: str) -> None:
    cfg = _cfg("qwen3-30b-a3b", "gguf:q4_k:q6_k")
    assert _plan(cfg, strategy=strategy).decode_misses == "copy"
    with pytest.raises(ConfigError, match=r"decode_misses 'link' needs moe_strategy auto or offload"):
        _ = _plan(cfg, strategy=strategy, decode_misses="link").decode_misses


def test_forced_choices_and_resident_plans() -> None:
    cfg = _cfg("qwen3-30b-a3b", "gguf:q4_k:q6_k")
    assert _plan(cfg, decode_misses="copy").decode_misses == "copy"
    assert _plan(_cfg("gpt-oss-20b"), decode_misses="link").decode_misses == "link"  # forced: measurable
    assert _plan(cfg, budget=None).strategy == "resident"
    assert _plan(cfg, budget=None).decode_misses == "copy"  # nothing misses
    assert _plan(cfg, kernels="torch").decode_misses == "copy"
    with pytest.raises(ConfigError, match="the Triton kernels, not FERRYMAN_KERNELS=torch"):
        _ = _plan(cfg, kernels="torch", decode_misses="link").decode_misses
    plan = _plan(cfg)
    with pytest.raises(ConfigError, match="needs moe_strategy"):
        plan_decode_misses(replace(plan.request, strategy="hybrid", decode_misses="link"), "offload", 0)


def test_link_steps_take_few_sequences() -> None:
    qwen, oss = _cfg("qwen3-30b-a3b"), _cfg("gpt-oss-20b")  # top-8 of 128; top-4 of 32
    assert [n for n in range(1, 20) if link_step_fits(qwen, n)] == list(range(1, 9))  # 64 pairs
    assert [n for n in range(1, 20) if link_step_fits(oss, n)] == list(range(1, 5))  # half of 32 experts


def test_report_and_prediction_follow_the_choice() -> None:
    cfg = _cfg("qwen3-30b-a3b", "int4:g128:sym")
    link, copy = _plan(cfg), _plan(cfg, decode_misses="copy")
    assert "read over the link by the decode kernel" in describe_plan(link)
    assert "up to 8 sequences" in describe_plan(link)
    assert "auto's choice, on trial" in describe_plan(link)
    assert "on trial" not in describe_plan(_plan(cfg, decode_misses="link"))  # asked for: kept
    assert "copied into slots layer by layer; under auto the CPU may take some" in describe_plan(copy)
    offload = describe_plan(_plan(cfg, decode_misses="copy", strategy="offload"))
    assert "copied into slots layer by layer\n" in offload + "\n"  # no split: nothing more to say
    assert "reads slowly over the link" in describe_plan(_plan(_cfg("gpt-oss-20b")))
    torch_kernels = describe_plan(_plan(cfg, kernels="torch"))  # the reason named, not the format blamed
    assert "link steps need the Triton kernels, not FERRYMAN_KERNELS=torch" in torch_kernels
    rates = Rates(55e9, "assumed")
    fast, slow = (predict(p, rates, Load(1, 128, 64, 0)).decode_tok_s for p in (link, copy))
    assert fast > 1.2 * slow  # no host step per layer: LINK_LAYER_S against LAYER_S
    many = [predict(p, rates, Load(16, 128, 64, 0)).decode_tok_s for p in (link, copy)]
    assert many[0] == pytest.approx(many[1])  # 16 sequences take the copy path either way
