"""A model without tokenizer files (dummy presets, bare checkpoints) behind the server: outputs are
shown as `<id>` per token, so `ferryman bench serve` and any OpenAI client see them stream; with
offloaded experts the bench reports the link bytes per output token from /v1/stats."""

from __future__ import annotations

from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from ferryman.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from ferryman.server.bench import BenchConfig, run_bench  # noqa: E402
from server_harness import LiveServer, start_server  # noqa: E402
from tiny_models import build_tiny  # noqa: E402


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    folder: Path = tmp_path_factory.mktemp("bare")
    build_tiny("olmoe", folder)
    assert not (folder / "tokenizer.json").exists()
    srv = start_server(str(folder), moe_strategy="offload", expert_cache=0.25)  # link bytes in /v1/stats
    yield srv
    srv.stop()


def test_detokenizer_without_tokenizer_shows_ids_and_honours_stops() -> None:
    d = IncrementalDetokenizer(None, stop=["<7>"])
    assert d.update([3]) == "<3>"
    assert d.update([3, 12]) == "<12>"
    assert d.update([3, 12, 7, 9]) == "" and d.stopped and d.text == "<3><12>"


def test_streamed_completion_text_is_the_token_ids(bare_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=bare_server.base_url, api_key="x", max_retries=0, timeout=60)
    stream = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=6, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    texts = [c.choices[0].text for c in stream if c.choices and c.choices[0].text]
    full = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert len(texts) == 6 and all(t.startswith("<") and t.endswith(">") for t in texts)
    assert "".join(texts) == full.choices[0].text
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=2)


def test_bench_serve_counts_tokens_of_a_model_without_tokenizer(bare_server: LiveServer) -> None:
    result = run_bench(BenchConfig(url=bare_server.url, levels=(1, 2), prompt_tokens=16, output_tokens=5,
                                   requests_per_level=2, token_id_range=(1, 200)))
    for level in result["levels"]:
        assert level["errors"] == 0 and level["output_tokens"] == 10, level
        assert level["itl_s_p50"] is not None and level["output_tokens_per_s"] > 0
        assert level["link_bytes"] >= 0 and level["link_bytes_per_output_token"] == level["link_bytes"] / 10
    # a level whose experts the previous one left cached may copy nothing; the first cannot
    assert result["levels"][0]["link_bytes"] > 0, result["levels"]


def test_bench_serve_reports_the_servers_error_message(bare_server: LiveServer) -> None:
    # ids beyond the tiny vocabulary (256): the server's 400 message reaches the report
    result = run_bench(BenchConfig(url=bare_server.url, levels=(1,), prompt_tokens=4, output_tokens=2,
                                   requests_per_level=1, token_id_range=(300, 400)))
    err = result["levels"][0]["first_error"]
    assert err.startswith("HTTP 400: ") and "vocab" in err.lower(), err


def test_bench_serve_zero_requests_per_level_means_one_per_user(bare_server: LiveServer) -> None:
    result = run_bench(BenchConfig(url=bare_server.url, levels=(1, 3), prompt_tokens=4, output_tokens=2,
                                   requests_per_level=0, token_id_range=(1, 200)))
    assert [(r["concurrency"], r["requests"], r["errors"]) for r in result["levels"]] == [(1, 1, 0), (3, 3, 0)]
