"""Honest finish reasons: a forced tool call cut by max_tokens ends "length" (Anthropic
"max_tokens") and is not returned as a call; the tool_choice "required" wrapper never reaches
`content`; a forced call that is not cut parses (the official SDKs' structured-output helpers)."""

from __future__ import annotations

import json
from typing import Literal

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("llguidance")

from pydantic import BaseModel, Field  # noqa: E402

from server_harness import LiveServer  # noqa: E402

USER = [{"role": "user", "content": "Weather in Oslo?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=7)
    rain: bool


@pytest.fixture(scope="module")
def client(server: LiveServer) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def aclient(server: LiveServer) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_cut_forced_call_is_length(client, choice) -> None:
    r = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice=choice, max_tokens=3)
    c = r.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls
    assert not c.message.content  # neither the cut arguments nor the {"name": ...} wrapper
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice=choice,
                                                 max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not any(ch.choices[0].delta.tool_calls or ch.choices[0].delta.content for ch in chunks)


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_whole_forced_call_is_tool_calls(client, choice) -> None:
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice=choice,
                                           max_tokens=60, temperature=1.0, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        args = json.loads(c.message.tool_calls[0].function.arguments)
        assert set(args) == {"city", "days"} and c.message.tool_calls[0].function.name == "get_weather"


def test_sdk_structured_output_through_a_forced_tool(client) -> None:
    """What LangChain's `with_structured_output` does: one strict tool, forced by name."""
    tool = openai.pydantic_function_tool(Forecast)
    for seed in range(3):
        r = client.chat.completions.parse(model="tiny", messages=USER, tools=[tool], max_tokens=60, seed=seed,
                                          tool_choice={"type": "function", "function": {"name": "Forecast"}})
        parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
        assert isinstance(parsed, Forecast) and 1 <= parsed.days <= 7
    with pytest.raises(openai.LengthFinishReasonError):  # cut: the SDK sees "length", not a broken call
        client.chat.completions.parse(model="tiny", messages=USER, tools=[tool], max_tokens=3,
                                      tool_choice={"type": "function", "function": {"name": "Forecast"}})


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_cut_forced_tool_use_is_max_tokens(aclient, choice) -> None:
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    r = aclient.messages.create(model="tiny", max_tokens=3, messages=USER, tools=[tool], tool_choice=choice)
    assert r.stop_reason == "max_tokens" and all(b.type != "tool_use" for b in r.content)
    assert "_raw" not in r.model_dump_json() and not "".join(getattr(b, "text", "") for b in r.content)
    with aclient.messages.stream(model="tiny", max_tokens=3, messages=USER, tools=[tool], tool_choice=choice) as s:
        kinds = [getattr(getattr(e, "content_block", None), "type", None) for e in s]
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and "tool_use" not in kinds
    whole = aclient.messages.create(model="tiny", max_tokens=60, messages=USER, tools=[tool], tool_choice=choice)
    use = [b for b in whole.content if b.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and set(use[0].input) == {"city", "days"}
