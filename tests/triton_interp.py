"""Helpers of the kernel tests: run a snippet under Triton's interpreter (TRITON_INTERPRET=1) in a
child process, and set FERRYMAN_KERNELS for one test.

The interpreter flag must be set before triton is first imported and must not leak into the test
process, where other tests may import triton normally.
"""

from __future__ import annotations

import functools
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


def use_kernels(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """FERRYMAN_KERNELS=value for the rest of the test: the process reads it once, so the cached
    reader is swapped for a fresh one (monkeypatch puts the old one back)."""
    from ferryman.layers import backend

    monkeypatch.setenv("FERRYMAN_KERNELS", value)
    monkeypatch.setattr(backend, "kernels", functools.cache(backend.kernels.__wrapped__))
