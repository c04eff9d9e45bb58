"""What a newcomer mistypes gets one line and exit status 2, never a traceback; every flag's help
shows its default."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferryman.cli import build_parser, main
from ferryman.envs import envs
from tiny_models import build_tiny

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def reread_environment(monkeypatch: pytest.MonkeyPatch):
    """main() reads the environment at start: give later tests the real one back."""
    yield
    monkeypatch.undo()
    envs.reload()


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """Runs `ferryman ARGV` in-process; asserts exit status 2 and a single stderr line, returns it."""
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert rc == 2, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv,says", [
    (["run", "--max-tokens", "-5"], "ferryman: error: --max-tokens must be >= 1, got -5"),
    (["run", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["run", "--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
    (["run", "--top-p", "5"], "--top-p must be in (0, 1], got 5.0"),
    (["run", "--top-k", "-3"], "--top-k must be -1, 0 (off) or >= 1, got -3"),
    (["run", "-p", ""], "--prompt is empty"),
    (["serve", "--port", "99999"], "argument --port: 99999 is not a port"),
    (["serve", "--port", "http"], "argument --port: 'http' is not a port number"),
    (["run", "--gpu-memory", "16"], "argument --gpu-memory: 16: give a unit, e.g. 16GiB"),
    (["plan", "--gpu-memory", "0.5"], "argument --gpu-memory: 0.5: give a unit, e.g. 0.5GiB"),
    (["serve", "--gpu-memory", "lots"], "argument --gpu-memory: must be a size like '16GiB'"),
    (["run", "--max-tokens", "many"], "argument --max-tokens: invalid int value: 'many'"),
    (["rn"], "ferryman: error: argument COMMAND: invalid choice: 'rn'"),
    (["run", "/no/such/model"], "model folder /no/such/model does not exist"),
    (["run", "gpt-oss-7b", "--load-format", "dummy"], "is not a built-in preset: "),
    (["run", "--dtype", "float8"], "unsupported dtype 'float8'; choose one of float32, bfloat16, float16"),
    (["run", "--device", "tpu"], "device must be cpu, cuda or auto, got 'tpu'"),
    (["run", "--max-model-len", "100000", "--device", "cpu"], "max_model_len 100000 exceeds the model's context"),
    (["plan", "--expert-cache", "lots"], "expert_cache must look like '10%', '0.1' or '64'"),
    (["bench", "serve", "localhost:8000"], "URL must start with http:// or https://"),
    (["run", "--calibration", "/no/rates.json"], "argument --calibration: /no/rates.json: no such file"),
])
def test_bad_flags_are_one_line_errors(argv: list[str], says: str, capsys: pytest.CaptureFixture) -> None:
    assert says in one_line_error(argv, capsys)


def test_bad_files_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "m"
    build_tiny("qwen3_moe", folder)
    capsys.readouterr()  # transformers' progress bar
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    for cut in (size // 2, size - 1, 5):  # cut inside the tensors, at the last byte, inside the header
        data = weights.read_bytes()
        weights.write_bytes(data[:cut])
        line = one_line_error(["run", str(folder), "--device", "cpu"], capsys)
        assert f"{weights} is not a readable safetensors file ({cut:,} bytes" in line and "truncated" in line
        weights.write_bytes(data)
    (folder / "tokenizer.json").write_text("not json")
    line = one_line_error(["run", str(folder), "--device", "cpu"], capsys)
    assert f"cannot load the tokenizer of {folder}" in line
    (folder / "tokenizer.json").unlink()
    (folder / "model.safetensors.index.json").write_text("[]")
    line = one_line_error(["run", str(folder), "--device", "cpu"], capsys)
    assert "model.safetensors.index.json is not a safetensors index" in line


def test_python_m_ferryman_prints_no_traceback() -> None:
    """The real entry point, as a shell runs it: stderr holds one line, exit status 2."""
    for argv in (["run", "--temperature", "-1"], ["serve", "--port", "99999"]):
        p = subprocess.run([sys.executable, "-m", "ferryman", *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser and every subcommand's parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers(sub)


def test_every_help_text_shows_its_default() -> None:
    """Each flag or argument that takes a value and may be left out says what leaving it out means;
    on/off switches (store_true) are off unless given."""
    walked = []
    for p in parsers(build_parser()):
        walked.append(p.prog)
        shown = "".join(p.format_help().split())  # argparse wraps lines, also after hyphens
        fmt = p._get_formatter()
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction, argparse._StoreTrueAction)):
                continue
            if action.required:
                continue
            text = " ".join(fmt._expand_help(action).split())
            name = "/".join(action.option_strings) or action.dest
            assert "default:" in text, f"`{p.prog} --help`: {name} does not show its default: {text!r}"
            assert "".join(text.split()) in shown, f"`{p.prog} --help` does not print {name}'s help"
    assert {"ferryman run", "ferryman serve", "ferryman plan", "ferryman info", "ferryman bench serve",
            "ferryman bench bw"} <= set(walked)


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[;(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_first_install_command_covers_every_import() -> None:
    """`pip install -e .` (the README's first command) brings every package ferryman imports, the
    server's included (theirs count: fastapi brings starlette); only the GPU kernels' triton and
    `bench serve --plot`'s matplotlib are optional."""
    tomllib = pytest.importorskip("tomllib")
    from importlib.metadata import packages_distributions, requires

    deps = {_name(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    covered = deps | {_name(r) for d in deps for r in requires(d) or [] if "extra ==" not in r}
    modules: set[str] = set()
    for path in (ROOT / "ferryman").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    dists = packages_distributions()
    third_party = {m for m in modules if m in dists and m not in ("ferryman", "triton", "matplotlib")}
    assert {"fastapi", "uvicorn", "pydantic", "prometheus_client", "llguidance", "starlette"} <= third_party
    missing = {m: dists[m] for m in third_party if not {_name(d) for d in dists[m]} & covered}
    assert not missing, f"imported but not installed by `pip install -e .`: {missing}"


def test_python_api_sizes_need_a_unit_too() -> None:
    """LLM(gpu_memory=...) as the flag: a string needs its unit; an int is bytes (at least 1 MiB)."""
    from ferryman.config import EngineConfig
    from ferryman.errors import ConfigError

    with pytest.raises(ConfigError, match="gpu_memory 16: give a unit, e.g. 16GiB"):
        EngineConfig(model="m", gpu_memory="16")
    with pytest.raises(ConfigError, match="gpu_memory 16: give a unit, e.g. '16GiB' \\(an int is a number of bytes\\)"):
        EngineConfig(model="m", gpu_memory=16)
    assert EngineConfig(model="m", gpu_memory=8 << 30).offload.gpu_memory == 8 << 30
