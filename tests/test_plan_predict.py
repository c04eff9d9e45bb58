"""`ferryman plan`'s predictions (plan_report.predict) on synthetic calibrations: the load replayed
through the engine's scheduling (chunk-major FCFS, layer-major jobs that share one stream of
experts), rates from the calibration, and the device-compute figures of a calibration file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ferryman.calibrate.calibration import DeviceCompute, load, save
from ferryman.models.registry import model_config
from ferryman.plan_report import LAYER_S, Load, Rates, StepCosts, predict, simulate, used_experts
from ferryman.planner import MemoryPlan, PlanRequest
from ferryman.planner_search import plan_memory
from ferryman.weights.presets import get_preset
from tiny_models import calibration_of, preset_config

# a synthetic device: a MoE layer costs 1 ms + 1 us per token, GEMMs run at 300 TFLOP/s
DEVICE = DeviceCompute(((256, 1.256e-3), (4096, 5.096e-3)), 3e14, 32)
RATES = Rates(50e9, "test", DEVICE.moe_seconds, DEVICE.matmul_flops, "test")


@pytest.fixture(scope="module")
def plan() -> MemoryPlan:
    return plan_memory(PlanRequest(model_config(get_preset("gpt-oss-20b")), torch.bfloat16, 8 << 30, 8192, 32))


def test_device_compute_interpolates_and_round_trips(tmp_path: Path) -> None:
    assert DEVICE.moe_seconds(256) == pytest.approx(1.256e-3) and DEVICE.moe_seconds(1024) == pytest.approx(2.024e-3)
    assert DEVICE.moe_seconds(8192) == pytest.approx(9.192e-3)  # the last slope beyond the points
    assert 0 < DEVICE.moe_seconds(16) <= DEVICE.moe_seconds(256) and DEVICE.moe_seconds(0) >= 0
    with pytest.raises(ValueError, match="ascending token counts"):
        DeviceCompute(((1024, 1e-3), (256, 2e-3)), 1e14, 32)
    cal = calibration_of(preset_config("gpt-oss-20b"), torch.bfloat16, 4000.0, 1000.0)
    with_device = dataclasses.replace(cal, device=DEVICE)
    save(with_device, tmp_path / "c.json")
    assert load(tmp_path / "c.json") == with_device
    save(cal, tmp_path / "old.json")  # a file without device figures still reads
    assert load(tmp_path / "old.json").device is None


def test_one_user_matches_the_stated_model(plan: MemoryPlan) -> None:
    """One request alone: its prompt is one chunk-major step (1024 <= the 4096-token step), then
    O - 1 decode steps; the TTFT is that step's link + kernels + fixed costs, layer by layer; after
    it the idle pages of the KV floor serve as slots."""
    costs = StepCosts(plan, RATES)
    p = predict(plan, RATES, Load(1, 1024, 128, 0))
    h = plan.expert_slots / 768  # the first step runs before any page moved
    link = 32 * (1 - h) * plan.slot_bytes / 50e9  # 1024 uniform tokens use every expert of a layer
    other = costs.dense_flops * 1024 + 4.0 * 12 * 1024 * 512 * 64 * 64 + 4.0 * 12 * 1024 * 128 * 64 * 64
    want = 24 * (link + DEVICE.moe_seconds(1024) + LAYER_S) + other / 3e14
    assert p.ttft_s == pytest.approx(want, rel=1e-6)
    assert p.slots > plan.expert_slots and p.hit_rate == pytest.approx(p.slots / 768)
    q = plan.pages.blocks_per_page  # the lone sequence's pages and the reserve stay KV, the rest are slots
    assert p.slots == plan.region_pages - -(-(-(-1152 // 16) + 4096 // 16) // q)
    assert 0 < p.output_tok_s < p.decode_tok_s  # the first token's wait is in the load's wall time
    assert used_experts(32, 4, 1) == pytest.approx(4) and used_experts(32, 4, 1000) == pytest.approx(32)


def test_the_split_follows_the_load(plan: MemoryPlan) -> None:
    """KV pages grow when a step needs blocks, and give idle pages beyond the reserve back after it."""
    costs = StepCosts(plan, RATES)
    q, start = plan.pages.blocks_per_page, plan.region_pages - plan.expert_slots
    assert costs.kv_pages(start, 5 * q, after=False) == start  # enough pages already
    assert costs.kv_pages(start, 40 * q, after=False) == 40  # ensure_kv
    assert costs.kv_pages(40, 5 * q, after=True) == 5 + -(-256 // q)  # rebalance keeps the reserve free
    most = plan.region_pages - costs.least
    assert costs.kv_pages(start, 10_000 * q, after=False) == most  # never below the least slots


def test_monotonic_in_prompt_length_users_and_link(plan: MemoryPlan) -> None:
    ttft = [predict(plan, RATES, Load(1, n, 16, 0)).ttft_s for n in (256, 1024, 4000, 6000, 8000)]
    assert ttft == sorted(ttft) and len(set(ttft)) == len(ttft)
    users = [predict(plan, RATES, Load(n, 1024, 64)) for n in (1, 2, 4, 8, 16, 32)]
    assert [p.ttft_s for p in users] == sorted(p.ttft_s for p in users)
    assert [p.output_tok_s for p in users] == sorted(p.output_tok_s for p in users)
    assert users[-1].slots < users[0].slots  # 32 users' KV takes pages from the experts
    faster = dataclasses.replace(RATES, link_bps=100e9)
    assert predict(plan, faster, Load(4, 1024, 64)).ttft_s < users[2].ttft_s
    assert predict(plan, faster, Load(4, 1024, 64)).output_tok_s > users[2].output_tok_s


def test_layer_major_prompts_share_one_stream(plan: MemoryPlan) -> None:
    """Prompts longer than a step that arrive together form one layer-major job: each uncached
    expert crosses the link once for all of them, so two take less than twice one; in chunk-major
    (no job) each 4096-token chunk streams the misses again."""
    assert plan.prefill_job_tokens == 8192
    one = predict(plan, RATES, Load(1, 4100, 1, 0)).ttft_s
    two = predict(plan, RATES, Load(2, 4000, 1, 0)).ttft_s
    assert one < two < 2 * one
    chunked = dataclasses.replace(plan, prefill_job_tokens=0)
    assert predict(chunked, RATES, Load(1, 8000, 1, 0)).ttft_s > predict(plan, RATES, Load(1, 8000, 1, 0)).ttft_s
    # two 6000-token prompts exceed one job (8192 tokens): the second job runs beside the first
    # prompt's decodes, layers_per_step = 24 * 4096 // 6000 = 16 layers a step, so it takes 2 steps
    replay = simulate(StepCosts(plan, RATES), Load(2, 6000, 8, 0))
    first, second = sorted(replay.ttfts)
    assert second - first > 0.5 * first and replay.wall_s > second
    assert replay.steps == 1 + 2 + 7  # job 1; job 2 beside 2 decodes; 7 more of the second's 8 tokens


def test_fcfs_chunks_order_the_first_tokens(plan: MemoryPlan) -> None:
    """Eight 1024-token prompts together: four fill a 4096-token step, the next four wait for it."""
    ttfts = simulate(StepCosts(plan, RATES), Load(8, 1024, 4, 0)).ttfts
    first, second = sorted(ttfts)[:4], sorted(ttfts)[4:]
    assert max(first) - min(first) < 1e-9 and min(second) > 1.5 * max(first)


def test_assumed_rates_say_so(plan: MemoryPlan) -> None:
    p = predict(plan, Rates(55e9, "assumed PCIe 5.0"), Load(1))
    assert p.compute_source == "assumed" and p.ttft_s > 0 and p.output_tok_s > 0


def _tiny_moe():
    from ferryman.config import ModelConfig

    return ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=32,
                       norm_topk_prob=True, router_kind="softmax_topk", router_bias=False, expert_act="silu",
                       expert_bias=False)


def test_device_compute_is_measured_on_the_engine_kernel() -> None:
    from ferryman.calibrate.device import measure_device_compute
    from ferryman.layers.fused_moe import MoEActivation

    got = measure_device_compute(_tiny_moe(), torch.float32, MoEActivation(kind="silu"), torch.device("cpu"), 1,
                                 tokens=(4, 16))
    assert [t for t, _ in got.moe] == [4, 16] and all(s > 0 for _, s in got.moe) and got.matmul_flops > 0


@pytest.mark.gpu
def test_device_compute_on_cuda_gpt_oss_20b_layer() -> None:
    """The figures `ferryman bench bw` keeps for `ferryman plan`'s TTFT: an MXFP4 layer of gpt-oss-20b
    at the measured token counts (grouped and batched paths) and a bf16 GEMM."""
    from ferryman.calibrate.device import MOE_TOKENS, measure_device_compute
    from ferryman.engine.model_runner import expert_activation

    cfg = model_config(get_preset("gpt-oss-20b"))
    got = measure_device_compute(cfg, torch.bfloat16, expert_activation(cfg), torch.device("cuda"), 3)
    assert [t for t, _ in got.moe] == list(MOE_TOKENS) and all(0 < s < 1.0 for _, s in got.moe)
    assert got.moe[-1][1] > got.moe[0][1] and 1e13 < got.matmul_flops < 1e16


def test_plan_takes_its_rates_from_the_calibration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`ferryman plan --calibration`: the link and the device's compute of the file; device figures
    measured over another expert count (gpt-oss-20b's 32, read for gpt-oss-120b's 128, one key) are
    not used."""
    from ferryman.calibrate.calibration import Rate
    from ferryman.cli import main
    from ferryman.cli_bench import calibrated_rates

    cfg20 = preset_config("gpt-oss-20b")
    cal = calibration_of(cfg20, torch.bfloat16, 4000.0, 1000.0)
    cal = dataclasses.replace(cal, h2d=Rate.of(1 / 3000.0, cal.key["row_bytes"], 5), device=DEVICE)
    save(cal, tmp_path / "cal.json")
    rates = calibrated_rates(cfg20, torch.bfloat16, str(tmp_path / "cal.json"))
    assert rates.link_bps == pytest.approx(3000.0 * cal.key["row_bytes"]) and rates.compute_source == "calibrated"
    assert rates.moe_seconds(1024) == pytest.approx(DEVICE.moe_seconds(1024))
    big = calibrated_rates(preset_config("gpt-oss-120b"), torch.bfloat16, str(tmp_path / "cal.json"))
    assert big.moe_seconds is None and "for 32 experts a layer" in big.compute_source
    assert calibrated_rates(cfg20, torch.bfloat16, str(tmp_path / "cal.json"), (1e9, "server")).link_bps == 1e9
    assert main(["plan", "gpt-oss-20b", "--gpu-memory", "8GiB", "--calibration", str(tmp_path / "cal.json")]) == 0
    out = capsys.readouterr().out
    assert "GB/s calibrated; compute calibrated" in out and "TTFT p50" in out
