"""`ferryman serve`'s access and limit flags: the API key's three sources, and the flags reaching
ServerConfig (nothing is served: `serve` is replaced)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ferryman.cli import build_parser, main
from ferryman.envs import envs


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("FERRYMAN_API_KEY", raising=False)
    envs.reload()
    yield
    monkeypatch.undo()
    envs.reload()


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The ServerConfig each `main(["serve", ...])` would serve with."""
    import ferryman.server

    got: list[Any] = []
    monkeypatch.setattr(ferryman.server, "serve", lambda kwargs, model, cfg, **kw: got.append(cfg))
    return got


def test_the_key_from_a_flag_a_file_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       served: list[Any]) -> None:
    assert main(["serve", "--api-key", "abc"]) == 0 and served[-1].api_key == "abc"
    (tmp_path / "key").write_text("from-file\nignored second line\n")
    assert main(["serve", "--api-key-file", str(tmp_path / "key")]) == 0 and served[-1].api_key == "from-file"
    monkeypatch.setenv("FERRYMAN_API_KEY", "from-env")
    assert main(["serve"]) == 0 and served[-1].api_key == "from-env"
    monkeypatch.delenv("FERRYMAN_API_KEY")
    assert main(["serve"]) == 0 and served[-1].api_key is None


@pytest.mark.parametrize("args, env, message", [
    (["--api-key", ""], None, "--api-key is empty"),
    (["--api-key", "  "], None, "--api-key is empty"),
    (["--api-key-file", "{empty}"], None, "the file is empty"),
    (["--api-key-file", "{missing}"], None, "cannot read it"),
    ([], "", "FERRYMAN_API_KEY is set but empty"),
    (["--api-key", "a"], "b", "given twice (--api-key and FERRYMAN_API_KEY)"),
])
def test_an_empty_or_doubled_key_stops_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture, served: list[Any],
                                                  args: list[str], env: str | None, message: str) -> None:
    (tmp_path / "empty").write_text("\n")
    args = [a.format(empty=tmp_path / "empty", missing=tmp_path / "nope") for a in args]
    if env is not None:
        monkeypatch.setenv("FERRYMAN_API_KEY", env)
    assert main(["serve", *args]) == 2 and not served
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_limit_flags_reach_the_server_config(served: list[Any]) -> None:
    assert main(["serve", "--body-timeout", "5", "--max-prompt-chars", "100000", "--drain-timeout", "0",
                 "--step-timeout", "90", "--trust-request-chat-template", "--template-timeout", "0.5"]) == 0
    cfg = served[-1]
    assert (cfg.body_timeout_s, cfg.max_prompt_chars, cfg.drain_timeout_s, cfg.step_timeout_s) == (5, 100000, 0, 90)
    assert cfg.trust_request_chat_template and cfg.template_timeout_s == 0.5
    a = build_parser().parse_args(["serve"])
    assert (a.body_timeout, a.drain_timeout, a.step_timeout, a.template_timeout) == (30.0, 30.0, 600.0, 2.0)
    assert not a.trust_request_chat_template and a.max_prompt_chars is None
    assert main(["serve", "--step-timeout", "0"]) == 2 and len(served) == 1
