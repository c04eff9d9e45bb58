"""`ferryman run` / `ferryman info` on the bundled demo model, as a user types them."""

from __future__ import annotations

import pytest

from ferryman.cli import build_parser, main
from ferryman.envs import envs


@pytest.fixture(autouse=True)
def reread_environment(monkeypatch: pytest.MonkeyPatch):
    """main() reads the environment at start: give later tests the real one back."""
    yield
    monkeypatch.undo()
    envs.reload()


def test_run_without_model_uses_demo_and_streams(capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "-p", "def add(a, b):", "--max-tokens", "8", "--device", "cpu", "--stats"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("def add(a, b):") and len(captured.out) > len("def add(a, b):\n")
    assert "8 tokens" in captured.err and "decode" in captured.err and "kv_cache_tokens" in captured.err


def test_info_without_model_describes_demo(capsys: pytest.CaptureFixture) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "qwen3_moe" in out and "32 per layer, top-4" in out and "10 (10 MoE)" in out
    assert "context: 32768 (RoPE yarn x16 over 2048)" in out


def test_every_command_has_help(capsys: pytest.CaptureFixture) -> None:
    for cmd in (["--help"], ["run", "--help"], ["info", "--help"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(cmd)
        assert e.value.code == 0
        assert "usage: ferryman" in capsys.readouterr().out


def test_chat_flag_uses_the_template(capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "-p", "hello", "--chat", "--max-tokens", "4", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "finish=length" in err or "finish=stop" in err


def test_run_without_tokenizer_shows_token_ids(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from tiny_models import build_tiny

    build_tiny("qwen3_moe", tmp_path / "m")
    assert main(["run", str(tmp_path / "m"), "-p", "hi", "--max-tokens", "5", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    prompt, output = captured.out.split("|")
    assert prompt.split() == ["104", "105"]  # "hi" as UTF-8 bytes
    assert len(output.split()) == 5 and all(0 <= int(t) < 256 for t in output.split())
    assert "no tokenizer" in captured.err
    assert main(["run", str(tmp_path / "m"), "-p", "hi", "--chat", "--device", "cpu"]) == 2


def test_help_shows_defaults_and_no_environment(capsys: pytest.CaptureFixture) -> None:
    texts = {}
    for cmd in ("run", "serve", "plan", "info"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([cmd, "--help"])
        texts[cmd] = capsys.readouterr().out
    run = " ".join(texts["run"].split())  # argparse wraps lines
    assert "--max-tokens MAX_TOKENS tokens to generate at most (default: 128)" in run
    assert "--moe-strategy STRATEGY where routed experts live" in run and "else offload) (default: auto)" in run
    assert "sequences decoded together (default: 1)" in run  # run plans for one prompt
    assert "--no-decode-prefetch" in run and "not measured" not in run
    assert "(default: 32, or under --gpu-memory" in " ".join(texts["serve"].split())
    assert "(default: 8000)" in texts["serve"] and "--gpu-memory SIZE" in texts["plan"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    top = capsys.readouterr().out
    assert "plan" in top and "serve" in top and "docs/configuration.md" in top
    assert not any("FERRYMAN_" in t for t in [top, *texts.values()])


def test_flags_build_the_engine_config() -> None:
    from ferryman.cli import engine_config

    a = build_parser().parse_args(["run", "m", "--gpu-memory", "8GiB", "--no-decode-prefetch", "--seed-weights",
                                   "3", "--seed", "7", "--expert-cache", "10%", "--kv-cache-dtype", "fp8"])
    ecfg = engine_config(a)
    assert (ecfg.model, ecfg.seed, ecfg.max_num_seqs, ecfg.kv_cache_dtype) == ("m", 3, 1, "fp8")
    assert (ecfg.offload.gpu_memory, ecfg.offload.expert_cache, ecfg.offload.decode_prefetch) == ("8GiB", "10%", False)
    assert a.sampling_seed == 7
    assert engine_config(build_parser().parse_args(["serve", "m"])).offload.decode_prefetch is True
    plan = engine_config(build_parser().parse_args(["plan", "m", "--max-num-seqs", "4"]))
    assert (plan.max_num_seqs, plan.device, plan.offload.moe_strategy) == (4, "auto", "auto")


def test_a_bad_environment_variable_is_a_one_line_error(capsys: pytest.CaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRYMAN_KERNELS", "cutlass")
    assert main(["info"]) == 2
    assert "FERRYMAN_KERNELS='cutlass' is invalid" in capsys.readouterr().err


def test_log_level_applies_to_the_ferryman_loggers(capsys: pytest.CaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    monkeypatch.setenv("FERRYMAN_LOG_LEVEL", "DEBUG")
    assert main(["plan", "--gpu-memory", "1GiB"]) == 0
    assert logging.getLogger("ferryman").level == logging.DEBUG
    logging.getLogger("ferryman.experts").info("a message from the experts")
    assert "[ferryman] INFO a message from the experts" in capsys.readouterr().err
    monkeypatch.setenv("FERRYMAN_LOG_LEVEL", "WARNING")
    assert main(["plan", "--gpu-memory", "1GiB"]) == 0
    logging.getLogger("ferryman.experts").info("hidden")
    assert "hidden" not in capsys.readouterr().err
    assert sum(getattr(h, "ferryman_cli", False) for h in logging.getLogger("ferryman").handlers) == 1


def test_debug_log_level_gives_tracebacks(monkeypatch: pytest.MonkeyPatch) -> None:
    from ferryman.errors import FerrymanError

    assert main(["info", "/no/such/model"]) == 2  # one-line error
    monkeypatch.setenv("FERRYMAN_LOG_LEVEL", "DEBUG")
    with pytest.raises(FerrymanError, match="does not exist"):
        main(["info", "/no/such/model"])
