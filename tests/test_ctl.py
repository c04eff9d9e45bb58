"""`ferryman ctl` and /v1/admin/memory against a live CPU server with offloaded experts: the split is
shown, bounds are set live (behind the API key), bad bounds are a 400 naming the bound; the
Prometheus gauges of the split and the counters of moves; and `ferryman plan`'s predictions."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from ferryman.cli import main
from ferryman.server.state import ServerConfig
from server_harness import serving

KEY = "sesame"


@pytest.fixture(scope="module")
def offloaded(tiny_model):
    with serving(str(tiny_model), ServerConfig(served_model_names=["tiny"], api_key=KEY), moe_strategy="offload",
                 expert_cache=12, min_expert_slots=2, kv_cache_tokens=64, max_model_len=64,
                 max_num_batched_tokens=32) as srv:
        yield srv


def _post(url: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json",
                                          **({"authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_ctl_shows_and_sets_the_split(offloaded, capsys: pytest.CaptureFixture[str]) -> None:
    url = offloaded.url
    assert main(["ctl", "--url", url, "--api-key", KEY]) == 0
    out = capsys.readouterr().out
    assert "kv cache:" in out and "experts: 12 slots" in out and "preemptions: 0" in out
    # a CPU server decodes without CUDA graphs: copies, whatever the plan's miss path
    assert "miss path: copied into slots layer by layer (decode without CUDA graphs)" in out
    assert main(["ctl", "set", "--url", url, "--api-key", KEY, "--max-expert-slots", "8", "--json"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert split["expert_pages"] == 8 and split["max_expert_slots"] == 8 and split["moves_to_kv"] >= 4
    # a request still runs after the move, and its KV may take the freed pages
    status, body = _post(url + "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 8})
    assert status == 200 and body["choices"][0]["text"] is not None
    assert main(["ctl", "set", "--url", url, "--api-key", KEY, "--max-expert-slots", "12"]) == 0
    capsys.readouterr()


def test_admin_endpoint_needs_the_key_and_names_a_bad_bound(offloaded) -> None:
    url = offloaded.url + "/v1/admin/memory"
    assert _post(url, {"max_expert_slots": 8}, key=None)[0] == 401
    status, body = _post(url, {"min_expert_slots": 10, "max_expert_slots": 9})
    assert status == 400 and "max_expert_slots must be >= min_expert_slots" in body["error"]["message"]
    status, body = _post(url, {"max_slots": 3})
    assert status == 400 and "max_slots" in json.dumps(body)
    status, body = _post(url, {"kv_reserve_tokens": -1})
    assert status == 400 and "kv_reserve_tokens" in json.dumps(body)


def test_ctl_errors_are_one_line(offloaded, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ctl", "--url", offloaded.url, "--api-key", "wrong"]) != 0
    err = capsys.readouterr().err  # (the server in this process logs to stderr too)
    errors = [line for line in err.splitlines() if line.startswith("ferryman: error")]
    assert len(errors) == 1 and "HTTP 401" in errors[0] and "Traceback" not in err
    assert main(["ctl", "set", "--url", offloaded.url]) != 0
    assert "give at least one of" in capsys.readouterr().err
    assert main(["ctl", "--url", "http://127.0.0.1:9"]) != 0
    assert "cannot reach the server" in capsys.readouterr().err


def test_prometheus_split_gauges_and_move_counters(offloaded) -> None:
    _post(offloaded.url + "/v1/admin/memory", {"max_expert_slots": 10})
    _post(offloaded.url + "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    req = urllib.request.Request(offloaded.url + "/metrics", headers={"authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read().decode()
    assert 'ferryman_memory_split_pages{owner="experts"}' in text and 'ferryman_memory_split_pages{owner="kv"}' in text
    assert 'ferryman_memory_moves_total{to="kv"}' in text and 'ferryman_kv_blocks{state="free"}' in text
    moved = [line for line in text.splitlines() if line.startswith('ferryman_memory_moves_total{to="kv"}')]
    assert float(moved[0].split()[-1]) > 0
    _post(offloaded.url + "/v1/admin/memory", {"max_expert_slots": 12})


def test_resident_server_says_there_is_no_split(server, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ctl", "--url", server.url]) == 0
    assert "no shared region" in capsys.readouterr().out
    status, body = _post(server.url + "/v1/admin/memory", {"max_expert_slots": 3}, key=None)
    assert status == 400 and "need offloaded experts" in body["error"]["message"]


def test_plan_predicts_decode_and_ttft(capsys: pytest.CaptureFixture[str]) -> None:
    from ferryman.models.registry import model_config
    from ferryman.plan_report import HBM_BPS, LAYER_S, Load, Rates, predict
    from ferryman.planner import PlanRequest
    from ferryman.planner_search import plan_memory
    from ferryman.weights.presets import get_preset

    assert main(["plan", "gpt-oss-20b", "--gpu-memory", "8GiB", "--max-num-seqs", "32", "--max-model-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert "predicted (1024 in / 128 out" in out and "32 users: output" in out and "TTFT p50" in out
    assert "compute assumed" in out  # no calibration file with device figures here
    plan = plan_memory(PlanRequest(model_config(get_preset("gpt-oss-20b")), torch.bfloat16, 8 << 30, 8192, 32))
    rates = Rates(50e9, "test")
    one, four, many = (predict(plan, rates, Load(n)) for n in (1, 4, 32))
    h = one.slots / 768
    row = plan.slot_bytes
    assert one.hit_rate == pytest.approx(h) and one.slots >= plan.expert_slots
    assert 1 / one.decode_tok_s == pytest.approx(24 * (4 * (1 - h) * row / 50e9 + LAYER_S + 4 * row / HBM_BPS))
    assert many.slots < one.slots  # 32 users' KV takes pages from the experts
    assert one.decode_tok_s < four.decode_tok_s < many.decode_tok_s and one.ttft_s < four.ttft_s < many.ttft_s
    assert predict(plan, Rates(100e9, "test"), Load(1)).decode_tok_s > one.decode_tok_s  # a faster link


def test_split_flags_build_the_engine_config() -> None:
    from ferryman.cli import build_parser, engine_config

    ecfg = engine_config(build_parser().parse_args(["serve", "m", "--min-expert-slots", "8", "--kv-reserve-tokens", "512"]))
    assert (ecfg.min_expert_slots, ecfg.kv_reserve_tokens) == (8, 512)
    with pytest.raises(Exception, match="min_expert_slots must be >= 1"):
        engine_config(build_parser().parse_args(["serve", "m", "--min-expert-slots", "0"]))


def test_the_miss_path_is_described_in_every_state() -> None:
    """`ferryman ctl`'s miss-path row: auto's link reads on trial, kept, or fallen back to copies."""
    from ferryman.cli_ctl import describe_miss_path

    on_trial = {"miss_path": "link", "link_trial": {"steps": 40, "verdict": None, "reason": ""}}
    assert "on trial against copies: 40 steps so far" in describe_miss_path(on_trial)
    kept = {"miss_path": "link", "link_trial": {"steps": 128, "verdict": True, "reason": "kept after a trial: x"}}
    assert describe_miss_path(kept).endswith("(kept after a trial: x)")
    fell = {"miss_path": "layer", "link_trial": {"steps": 128, "verdict": False,
                                                 "reason": "fell back to copies after a trial: y"}}
    assert describe_miss_path(fell) == "copied into slots layer by layer (auto: fell back to copies after a trial: y)"
    assert describe_miss_path({"miss_path": "link", "link_trial": None}).startswith("read over the link")
    assert describe_miss_path({"miss_path": "none", "link_trial": None}) == "none: every expert resident"
