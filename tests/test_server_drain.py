"""SIGTERM on a real `python -m ferryman serve` (demo model, CPU): new requests get 503 and /health
says draining, a stream that ends within the drain period ends normally, the others end with
their API's error event (OpenAI: then [DONE]), and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]
DRAIN_S = 6.0  # the short stream needs 4 steps within it, even on a loaded 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(url: str, path: str, body: dict, out: list[str], first: threading.Event) -> None:
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                out.append(line)
                first.set()


def _never_ending_demo(tmp_path: Path) -> Path:
    """The demo model with no end-of-sequence id it would write (8191 is a rare byte-pair): the
    chat-tuned model ends its turns, and the Anthropic API has no ignore_eos, but one stream must
    still be running when the drain period ends."""
    src, dst = ROOT / "ferryman" / "assets" / "demo-moe", tmp_path / "demo-moe"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        elif f.suffix == ".json":
            d = json.loads(f.read_text())
            if "eos_token_id" in d:
                d["eos_token_id"] = [8191] if isinstance(d["eos_token_id"], list) else 8191
            if "eos_token" in d:
                d["eos_token"] = None
            (dst / f.name).write_text(json.dumps(d))
    return dst


def test_sigterm_drains_then_exits_0(tmp_path: Path) -> None:
    model = _never_ending_demo(tmp_path)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "FERRYMAN_API_KEY"}
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "ferryman", "serve", str(model), "--port", str(port), "--device", "cpu",
                             "--no-warm-up", "--max-model-len", "1024", "--drain-timeout", str(DRAIN_S)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        chat = {"model": "demo-moe", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "ignore_eos": True}
        runs = {"short": ("/v1/chat/completions", {**chat, "max_tokens": 4}),
                "long": ("/v1/chat/completions", {**chat, "max_tokens": 1000}),
                "anthropic": ("/v1/messages", {**chat, "max_tokens": 1000, "temperature": 0})}  # no ignore_eos there
        outs: dict[str, list[str]] = {name: [] for name in runs}
        started = {name: threading.Event() for name in runs}
        threads = [threading.Thread(target=_stream, args=(url, p, b, outs[n], started[n]))
                   for n, (p, b) in runs.items()]
        for t in threads:
            t.start()
        for e in started.values():
            assert e.wait(30)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        short_done_before = "data: [DONE]" in outs["short"]
        time.sleep(0.3)
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        r = httpx.post(url + "/v1/chat/completions", json={**chat, "stream": False, "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        for t in threads:
            t.join(30)
        assert proc.wait(30) == 0
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    logged = log.read()
    assert DRAIN_S - 0.5 < took < DRAIN_S + 8, (took, logged[-2000:])
    assert not short_done_before  # it was running when the signal came, and then finished
    assert outs["short"][-1] == "data: [DONE]" and '"finish_reason": "length"' in outs["short"][-2]
    assert outs["long"][-1] == "data: [DONE]", outs["long"][-3:]
    assert '"error"' in outs["long"][-2] and "drain period" in outs["long"][-2]
    assert outs["anthropic"][-2:][0] == "event: error" and "drain period" in outs["anthropic"][-1]
    assert "drain period of 6 s over: ended 2 requests" in logged and "Traceback" not in logged
