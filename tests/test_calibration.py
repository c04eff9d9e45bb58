"""The calibration file (`ferryman bench bw`): keying, round trip, the measurements behind it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ferryman.calibrate.calibration import (
    Rate,
    default_path,
    expert_key,
    fingerprint,
    load,
    load_matching,
    machine_info,
    save,
    token_slope,
)
from tiny_models import calibration_of, demo_config, preset_config


def test_calibration_round_trip_and_keying(tmp_path: Path) -> None:
    qwen = preset_config("qwen3-30b-a3b")
    cal = calibration_of(qwen, torch.bfloat16, 4000.0, 1000.0)
    save(cal, tmp_path / "c.json")
    assert load(tmp_path / "c.json") == cal
    full = dataclasses.replace(cal, h2d=cal.host_copy, host_read_gbps=93.0,
                               overlapped={"link": cal.host_copy, "cpu": cal.cpu_compute},
                               cpu_tokens=Rate.of(1 / 600.0, cal.key["expert_bytes"], 5))
    save(full, tmp_path / "full.json")
    assert load(tmp_path / "full.json") == full
    got, why = load_matching(cal.key, tmp_path / "c.json")
    assert got == cal and "read" in why
    # same format (dense), another expert size or dtype: another key, the file is not used
    wider = dataclasses.replace(qwen, moe_intermediate_size=1536)
    for key in (expert_key(wider, torch.bfloat16), expert_key(qwen, torch.float16)):
        assert key["format"] == cal.key["format"] and fingerprint(key) != cal.fingerprint
        assert default_path(key) != default_path(cal.key)
        assert load_matching(key, tmp_path / "c.json")[0] is None
    assert expert_key(qwen, torch.bfloat16)["expert_bytes"] == 3 * 2048 * 768 * 2
    moved = dataclasses.replace(cal, machine={**cal.machine, "threads": cal.machine["threads"] + 1})
    save(moved, tmp_path / "m.json")
    got, why = load_matching(cal.key, tmp_path / "m.json")
    assert got is None and "threads" in why
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        load(tmp_path / "bad.json")


def test_bench_bw_on_cpu_prints_measured_numbers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from ferryman.cli import main

    out = tmp_path / "cal.json"
    assert main(["bench", "bw", "--output", str(out), "--reps", "3", "--read-mib", "16", "--pool-mib", "8"]) == 0
    text = capsys.readouterr().out
    cal = load(out)
    assert cal.key == expert_key(demo_config(), torch.bfloat16) and cal.machine == machine_info()
    assert f"host read: {cal.host_read_gbps:.1f} GB/s" in text
    assert f"CPU compute: {cal.cpu_compute.experts_per_s:,.0f} experts/s" in text
    assert "skipped, no CUDA device" in text and cal.h2d is None
    assert cal.cpu_compute.reps == 3 and cal.host_copy.experts_per_s > 0 and f"wrote {out}" in text
    slope = token_slope(cal.cpu_compute.experts_per_s, cal.cpu_tokens.experts_per_s)
    assert f"4 tokens per expert: {cal.cpu_tokens.experts_per_s:,.0f} experts/s" in text
    assert f"costs {slope:.2f} of a 1-token expert" in text
    with pytest.raises(SystemExit):
        main(["bench", "bw", "--help"])
    assert "keyed by the expert geometry and" in capsys.readouterr().out


def test_bench_bw_json_without_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`bench bw --json`: one JSON object on stdout (progress on stderr): the calibration, the host
    read bandwidth and each CPU kernel's GB/s at 1, 8 and 32 tokens beside it."""
    import json

    from ferryman.calibrate.kernels import KERNEL_TOKENS, KERNELS, kernel_fits
    from ferryman.cli import main
    from ferryman.quant import cpu_kernel

    out = tmp_path / "cal.json"
    assert main(["bench", "bw", "--json", "--output", str(out), "--reps", "3", "--read-mib", "16",
                 "--pool-mib", "8"]) == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out)
    assert "host read:" in captured.err and got["path"] == str(out) and got["calibration"]["h2d"] is None
    read = got["host_read_gbps"]
    assert read > 0 and got["cpu_kernel"]["isa"] == cpu_kernel.isa_name()
    if not cpu_kernel.available():
        assert got["cpu_kernels"] == []
        return
    rows = {(r["kernel"], r["tokens"]): r for r in got["cpu_kernels"]}
    labels = {r["kernel"] for r in got["cpu_kernels"]}
    assert {k[0] for k in KERNELS[:4]} <= labels  # MXFP4 and dense: any dims; packed ones where they fit
    assert sorted(rows) == sorted((k[0], t) for k in KERNELS if k[0] in labels for t in KERNEL_TOKENS)
    assert kernel_fits("gguf:q4_k:q4_k", 2048, 768) and not kernel_fits("gguf:q4_k:q4_k", 2880, 2880)
    for r in rows.values():
        assert r["gbps"] > 0 and r["of_host_read"] == pytest.approx(r["gbps"] / read)
        assert r["gbps"] == pytest.approx(r["experts_per_s"] * r["expert_bytes"] / 1e9)


def test_expert_cycle_walks_every_expert_of_every_pool() -> None:
    from ferryman.calibrate.bandwidth import ExpertCycle

    cycle = ExpertCycle(pools=2, experts=5, k=2)
    reps = [cycle.next() for _ in range(5)]
    assert reps == [(0, [0, 1]), (0, [2, 3]), (0, [4, 0]), (1, [1, 2]), (1, [3, 4])]
    assert cycle.next() == (0, [0, 1])
    with pytest.raises(ValueError):
        ExpertCycle(pools=1, experts=2, k=3)


def test_overlapped_measures_both_loops_over_the_window() -> None:
    """The CUDA-only 'together' figure, run here with a host copy as the link: both loops run for the
    window and count what they finished."""
    import time

    from ferryman.calibrate.bandwidth import MiB, dummy_copy_rep, dummy_cpu_rep, overlapped
    from ferryman.layers.fused_moe import MoEActivation

    cfg = demo_config()
    key = expert_key(cfg, torch.bfloat16)
    link, pinned = dummy_copy_rep(key["row_bytes"], cfg.top_k, 8 * MiB, torch.device("cpu"))
    assert not pinned  # a host target is never pinned
    cpu = dummy_cpu_rep(cfg, torch.bfloat16, MoEActivation(), 8 * MiB)
    start = time.perf_counter()
    both = overlapped(link, cfg.top_k, cpu, cfg.top_k, key["expert_bytes"], 0.2)
    assert 0.2 <= time.perf_counter() - start < 2.0
    assert both["link"].reps >= cfg.top_k and both["cpu"].reps >= cfg.top_k
    assert both["cpu"].gbps == pytest.approx(both["cpu"].experts_per_s * key["expert_bytes"] / 1e9)


@pytest.mark.gpu
def test_cuda_bench_bw_measures_the_link(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from ferryman.cli import main

    out = tmp_path / "cal.json"
    assert main(["bench", "bw", "--output", str(out), "--reps", "3", "--read-mib", "64", "--pool-mib", "64"]) == 0
    cal = load(out)
    assert cal.h2d is not None and cal.overlapped is not None and "link:" in capsys.readouterr().out
    # the device's prefill compute, what `ferryman plan` predicts TTFT with (calibrate/device.py)
    assert cal.device is not None and cal.device.experts == demo_config().num_experts
    assert all(s > 0 for _, s in cal.device.moe) and cal.device.matmul_flops > 1e12
