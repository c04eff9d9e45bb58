"""What Claude Code sends and reads on /v1/messages: system messages inside `messages`, errors in
Anthropic's wording, usage with cache reads the same in message_start and message_delta."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

from ferryman import LLM, SamplingParams  # noqa: E402
from server_harness import LiveServer, start_server  # noqa: E402

BETA = {"anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07"}
GREEDY = {"temperature": 0}
TURNS = [{"role": "user", "content": "List the files."}, {"role": "assistant", "content": "a.py b.py"},
         {"role": "user", "content": "Open a.py."}]
REMINDER = {"role": "system", "content": [{"type": "text", "text": "The user switched to plan mode."}]}
# ChatML that, like Qwen3.5's template, allows a system message first only
FIRST_SYSTEM_ONLY = (
    "{%- for message in messages -%}{%- if message['role'] == 'system' and not loop.first -%}"
    "{{ raise_exception('System message must be at the beginning.') }}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


@pytest.fixture(scope="module")
def client(server: LiveServer) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60, default_headers=BETA)


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), device="cpu", dtype="float32")


def _greedy(llm: LLM, ids: list[int], n: int) -> str:
    return llm.generate(prompt_token_ids=[ids], params=SamplingParams(temperature=0, max_tokens=n))[0].text


def test_system_message_mid_conversation(client, llm: LLM) -> None:
    msgs = [*TURNS, REMINDER]
    r = client.messages.create(model="tiny", max_tokens=8, system="Be brief.", messages=msgs, extra_body=GREEDY)
    want = llm.chat_ids([{"role": "system", "content": "Be brief."}, *TURNS,
                         {"role": "system", "content": "The user switched to plan mode."}])
    assert client.messages.count_tokens(model="tiny", system="Be brief.", messages=msgs).input_tokens == len(want)
    assert r.content[0].text == _greedy(llm, want, 8)
    after_assistant = [*TURNS[:2], {"role": "system", "content": "Mind the tests."}, TURNS[2]]
    n = client.messages.count_tokens(model="tiny", messages=after_assistant).input_tokens
    assert n == len(llm.chat_ids([*TURNS[:2], {"role": "system", "content": "Mind the tests."}, TURNS[2]]))


def test_system_message_with_a_non_text_block(client) -> None:
    bad = {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=[*TURNS, bad])
    assert e.value.body["error"]["message"].startswith("messages.3.content.0.type:")


def test_template_without_mid_system_gets_reminders(tmp_path: Path, tiny_model: Path) -> None:
    folder = tmp_path / "first-system-only"
    shutil.copytree(tiny_model, folder)
    cfg_file = folder / "tokenizer_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "chat_template": FIRST_SYSTEM_ONLY}))
    srv = start_server(str(folder))
    try:
        c = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60, default_headers=BETA)
        r = c.messages.create(model="tiny", max_tokens=4, messages=[*TURNS, REMINDER], extra_body=GREEDY)
        assert r.type == "message"
        n = c.messages.count_tokens(model="tiny", messages=[*TURNS, REMINDER]).input_tokens
        folded = [*TURNS[:2], {"role": "user", "content": "Open a.py.\n\n<system-reminder>\nThe user switched to "
                                                          "plan mode.\n</system-reminder>"}]
        assert n == len(LLM(str(folder), device="cpu", dtype="float32").chat_ids(folded))
    finally:
        srv.stop()


def test_error_wording(server: LiveServer, client) -> None:
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", "messages": TURNS}, headers=BETA)
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", "max_tokens": 4,
                                                      "messages": [{"role": "robot", "content": "x"}]})
    assert r.json()["error"]["message"].startswith("messages.0.role: Input should be")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=TURNS, extra_body={"n": 2})
    assert e.value.body["error"] == {"type": "invalid_request_error", "message": "n: Extra inputs are not permitted"}
    assert httpx.get(server.url + "/health").status_code == 200


def test_usage_same_in_message_start_and_delta(client) -> None:
    system = "You are a coding agent. " + " ".join(f"Rule {i}: keep it short." for i in range(20))
    kw = dict(model="tiny", max_tokens=6, system=system, messages=TURNS, extra_body=GREEDY)
    whole = client.messages.create(**kw)  # fills the prefix cache
    total = client.messages.count_tokens(model="tiny", system=system, messages=TURNS).input_tokens
    events = list(client.messages.create(**kw, stream=True))
    start = next(e for e in events if e.type == "message_start").message.usage
    end = next(e for e in events if e.type == "message_delta").usage
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    assert start.cache_read_input_tokens > 0 and start.input_tokens + start.cache_read_input_tokens == total
    assert (start.input_tokens, start.cache_read_input_tokens) == (end.input_tokens, end.cache_read_input_tokens)
    assert end.output_tokens == whole.usage.output_tokens and start.output_tokens == 0
    again = client.messages.create(**kw)
    assert again.usage.cache_read_input_tokens == start.cache_read_input_tokens
    assert again.usage.input_tokens == start.input_tokens
