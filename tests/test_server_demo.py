"""The bundled demo model behind the server: prefix-cache speed-up of an agent's second turn, and
`ferryman bench serve` against it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from ferryman.cli import main  # noqa: E402
from ferryman.llm import default_model  # noqa: E402
from ferryman.server import ServerConfig  # noqa: E402
from server_harness import LiveServer, start_server  # noqa: E402


@pytest.fixture(scope="module")
def server() -> LiveServer:
    srv = start_server(default_model(), ServerConfig(), dtype="auto", max_num_batched_tokens=2048)
    yield srv
    srv.stop()


def _ttft(client, messages: list[dict]) -> tuple[float, int, int]:
    """(seconds to the first generated token, prompt tokens, cached prompt tokens)."""
    start, first, usage = time.perf_counter(), None, None
    stream = client.chat.completions.create(model="demo-moe", messages=messages, max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and first is None and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            first = time.perf_counter() - start
        usage = chunk.usage or usage
    return first, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def test_cached_prefix_prefill_is_faster(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    tools = "\n".join(f"def tool_{i}(path, mode='r'):\n    return open(path, mode).read()" for i in range(40))
    turn1 = [{"role": "system", "content": "You are a coding agent with these tools:\n" + tools},
             {"role": "user", "content": "Read setup.py."}]
    cold, n1, cached1 = _ttft(client, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": "tool_3('setup.py')"},
                     {"role": "user", "content": "Now read README.md."}]
    warm, n2, cached2 = _ttft(client, turn2)
    assert n1 > 500 and cached1 == 0
    assert cached2 >= (n1 // 16) * 16  # the whole first prompt (in full blocks) came from the cache
    assert warm < cold / 3, f"cached prefill {warm:.3f} s is not much faster than cold {cold:.3f} s"


def test_bench_serve_cli(server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "serve", server.url, "--concurrency", "1,2", "--prompt-tokens", "32",
               "--output-tokens", "8", "--requests-per-level", "4", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["config"]["model"] == "demo-moe"
    assert [r["concurrency"] for r in result["levels"]] == [1, 2]
    for r in result["levels"]:
        assert r["errors"] == 0 and r["requests"] == 4 and r["output_tokens"] == 32  # ignore_eos: exact lengths
        assert 0 < r["ttft_s_p50"] <= r["ttft_s_p99"] and 0 < r["itl_s_p50"] <= r["itl_s_p99"]
        assert r["output_tokens_per_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "c=  2" in capsys.readouterr().out


def test_bench_unreachable_server_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "serve", "http://127.0.0.1:9", "--concurrency", "1"]) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
