"""Anthropic API (/v1/messages, count_tokens) against a live server, through the official `anthropic` client."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("llguidance")

from ferryman import LLM, SamplingParams  # noqa: E402
from server_harness import LiveServer, scripted  # noqa: E402

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}}}


@pytest.fixture(scope="module")
def client(server: LiveServer) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


GREEDY = {"temperature": 0}  # this client version has no temperature argument


def _ask(client, text: str, **kw):
    return client.messages.create(model="tiny", max_tokens=kw.pop("max_tokens", 10),
                                  messages=[{"role": "user", "content": text}], extra_body=GREEDY, **kw)


def test_message_matches_offline_engine(client, tiny_model: Path) -> None:
    r = _ask(client, "Hello there", system="Be brief.", max_tokens=10)
    llm = LLM(str(tiny_model), device="cpu", dtype="float32")
    ids = llm.chat_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    want = llm.generate(prompt_token_ids=[ids], params=SamplingParams(temperature=0, max_tokens=10))[0]
    assert r.type == "message" and r.role == "assistant"
    assert r.content[0].type == "text" and r.content[0].text == want.text
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == len(ids)
    assert r.usage.output_tokens == len(want.token_ids)
    assert r.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")


def test_count_tokens(client, tiny_model: Path) -> None:
    n = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "Count me"}])
    ids = LLM(str(tiny_model), device="cpu", dtype="float32").chat_ids([{"role": "user", "content": "Count me"}])
    assert n.input_tokens == len(ids)


def test_stream_event_sequence(client) -> None:
    whole = _ask(client, "Stream this", max_tokens=8)
    with client.messages.stream(model="tiny", max_tokens=8, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Stream this"}]) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events[1] == "content_block_start" and "content_block_stop" in events and "message_delta" in events


def test_stop_sequence(client) -> None:
    free = _ask(client, "Keep going", max_tokens=12).content[0].text
    stop = free[4:7]
    r = _ask(client, "Keep going", max_tokens=12, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == free[:free.index(stop)]


def test_tool_use_round_trip(client) -> None:
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    r = client.messages.create(model="tiny", max_tokens=30, messages=msgs, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"})
    use = [b for b in r.content if b.type == "tool_use"][0]
    assert r.stop_reason == "tool_use" and use.name == "get_weather" and use.input["city"] in ("Paris", "Oslo")
    msgs += [{"role": "assistant", "content": r.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12 C, rain"}]}]
    r2 = client.messages.create(model="tiny", max_tokens=5, messages=msgs, tools=[WEATHER], extra_body=GREEDY)
    assert r2.usage.input_tokens + (r2.usage.cache_read_input_tokens or 0) > r.usage.input_tokens
    n = client.messages.count_tokens(model="tiny", messages=msgs, tools=[WEATHER])
    assert n.input_tokens == r2.usage.input_tokens + (r2.usage.cache_read_input_tokens or 0)


def test_thinking_and_tool_use_blocks(client, server: LiveServer) -> None:
    """A scripted Qwen3-style output comes back as thinking, text and tool_use blocks, whole and streamed."""
    text = ('<think>\nCheck the sky.\n</think>\n\nLet me look.<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    with scripted(server, text):
        kw = dict(model="tiny", max_tokens=80, tools=[WEATHER], thinking={"type": "enabled", "budget_tokens": 64},
                  messages=[{"role": "user", "content": "Weather?"}])
        r = client.messages.create(**kw)
        with client.messages.stream(**kw) as stream:
            kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
            final = stream.get_final_message()
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use"]
    assert r.content[0].thinking == "\nCheck the sky.\n" and r.content[1].text == "Let me look."
    assert r.content[2].input == {"city": "Paris"} and r.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == r.content[0].thinking and final.content[2].input == {"city": "Paris"}
    assert ("content_block_delta", "thinking_delta") in kinds and ("content_block_delta", "input_json_delta") in kinds


def test_structured_output(client) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
              "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": schema}}}
    r = client.messages.create(model="tiny", max_tokens=30, messages=[{"role": "user", "content": "JSON please"}],
                               extra_body={**GREEDY, **fmt})
    obj = json.loads(r.content[0].text)
    assert set(obj) == {"ok", "n"} and r.stop_reason == "end_turn"


def test_anthropic_style_errors(client) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "image" in e.value.body["error"]["message"]
    assert json.dumps(e.value.body).startswith('{"type": "error"')
