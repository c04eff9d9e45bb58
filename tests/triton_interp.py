"""Helpers of the kernel tests: run a snippet under Triton's interpreter (TRITON_INTERPRET=1) in a
child process, and set for one test an environment variable that the process reads once.

The interpreter flag must be set before triton is first imported and must not leak into the test
process, where other tests may import triton normally.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, timeout: float = 300) -> str:
    """Run `script` with TRITON_INTERPRET=1; fail the test with its output unless it exits 0."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"interpreted Triton script failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def set_read_once(monkeypatch: pytest.MonkeyPatch, attr: str, value: str) -> None:
    """FERRYMAN_<attr> = value for the rest of the test: the process reads its variables once
    (`ferryman.envs.envs`), so the environment and that one read value both change (a bad value
    raises ConfigError here, as at start); monkeypatch puts both back."""
    from ferryman.envs import VARS, envs

    monkeypatch.setenv(f"FERRYMAN_{attr}", value)
    monkeypatch.setattr(envs, attr, VARS[attr].get())


def use_kernels(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """FERRYMAN_KERNELS=value for the rest of the test."""
    set_read_once(monkeypatch, "KERNELS", value)


def use_cpu_kernel(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """The CPU expert kernel on (FERRYMAN_KERNELS=auto) or off (torch) for the rest of the test."""
    set_read_once(monkeypatch, "KERNELS", "auto" if on else "torch")
