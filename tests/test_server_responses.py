"""OpenAI Responses API (/v1/responses) against a live server, parsed by the official `openai` SDK."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pydantic
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from ferryman.server import ServerConfig  # noqa: E402
from server_harness import LiveServer, delay_steps, scripted, serving, start_server  # noqa: E402
from test_server_harmony import ANSWER, harmony_model  # noqa: E402, F401 - the tiny gpt-oss fixture

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city", "strict": True,
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                          "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}
HOSTED = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]},
          {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
          {"type": "mcp", "server_label": "x", "server_url": "https://example.invalid"}]
CODEX_REQUEST = Path(__file__).parent / "fixtures" / "codex_cli_0.171_second_request.json"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    """The tiny chat model with a 16k context: Codex CLI's prompts are 11-12k tokens."""
    folder = tmp_path_factory.mktemp("tiny-16k")
    for f in tiny_model.iterdir():
        shutil.copy(f, folder / f.name)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16384}))
    with serving(str(folder), max_num_batched_tokens=2048) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _events(client, **kw) -> list:
    return list(client.responses.create(model="tiny", stream=True, **kw))


def test_text_is_the_chat_completion(client) -> None:
    """Same prompt tokens and greedy output as /v1/chat/completions with the same conversation."""
    r = client.responses.create(model="tiny", instructions="Be brief.", input="Write a haiku.",
                                max_output_tokens=12, temperature=0)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a haiku."}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == ("max_output_tokens" if cut else None)


def test_stream_builds_the_same_response(client, server: LiveServer) -> None:
    with scripted(server, "Hello there, friend."):
        whole = client.responses.create(model="tiny", input="Hi", max_output_tokens=40)
        events = _events(client, input="Hi", max_output_tokens=40)
        with client.responses.stream(model="tiny", input="Hi", max_output_tokens=40) as s:
            final = s.get_final_response()
    assert whole.status == final.status == "completed"
    assert whole.output_text == final.output_text == "Hello there, friend."
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there, friend."
    done = events[-1].response
    assert done.output[0].id == events[2].item.id and done.output[0].status == "completed"
    assert done.usage.output_tokens == whole.usage.output_tokens


def test_forced_tool_call_with_hosted_tools_offered(client) -> None:
    """tool_choice naming a function: a function_call item whose arguments parse; hosted tools are
    declined without failing the request."""
    kw = dict(model="tiny", input="Weather in Paris for 2 days?", tools=[WEATHER, *HOSTED], max_output_tokens=60,
              tool_choice={"type": "function", "name": "get_weather"})
    r = client.responses.create(**kw)
    call = r.output[-1]
    assert r.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    args = json.loads(call.arguments)
    assert args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7
    with client.responses.stream(**kw) as s:
        final = s.get_final_response()
    fc = final.output[-1]
    assert fc.type == "function_call" and json.loads(fc.arguments)["city"] in ("Paris", "Oslo", "Lima")
    plain = client.responses.create(model="tiny", input="Hi", tools=HOSTED, max_output_tokens=3)
    assert plain.output[0].type == "message" and [t.type for t in plain.tools] == [t["type"] for t in HOSTED]


def test_required_tool_choice(client) -> None:
    r = client.responses.create(model="tiny", input="Weather?", tools=[WEATHER], tool_choice="required",
                                max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments)
    assert not [o for o in r.output if o.type == "message"]


def test_function_call_output_round_trip(client) -> None:
    """Responses items render the same prompt as the chat messages they stand for."""
    items = [{"role": "developer", "content": "Use tools."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Oslo", "days": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"temp_c": 4}'},
             {"type": "web_search_call", "id": "ws_1", "status": "completed"}]  # hosted: skipped
    r = client.responses.create(model="tiny", input=items, tools=[WEATHER], max_output_tokens=4, temperature=0)
    msgs = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 4}'}]
    chat_tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    chat = client.chat.completions.create(model="tiny", messages=msgs, tools=[chat_tool], max_tokens=4, temperature=0)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == (chat.choices[0].message.content or "")


def test_json_schema_output(client) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    r = client.responses.create(model="tiny", input="A person.", max_output_tokens=80,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    obj = json.loads(r.output_text)
    assert set(obj) == {"name", "age"} and 0 <= obj["age"] <= 120 and r.text.format.type == "json_schema"
    assert r.status == "completed"

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        age: int = pydantic.Field(ge=0, le=120)

    parsed = client.responses.parse(model="tiny", input="A person.", text_format=Person, max_output_tokens=80)
    assert isinstance(parsed.output_parsed, Person) and 0 <= parsed.output_parsed.age <= 120


def test_max_output_tokens_cuts_a_tool_call_incomplete(client) -> None:
    """A forced call cut by max_output_tokens is never a completed function_call."""
    kw = dict(input="Weather?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=3)
    for choice in (kw["tool_choice"], "required"):
        r = client.responses.create(model="tiny", **{**kw, "tool_choice": choice})
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert all(o.status == "incomplete" for o in r.output if o.type == "function_call")
        assert not [o for o in r.output if o.type == "message"]  # the cut call is no message text
    events = _events(client, **kw)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert all(i.status == "incomplete" for i in done)


def test_parsed_reasoning_and_namespace_call(client, server: LiveServer) -> None:
    """Qwen3 markup -> a reasoning item (reasoning_text) and a function_call of a namespace tool."""
    ns = {"type": "namespace", "name": "crm", "description": "Customer records",
          "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]}
    text = ('<think>\nNeed the record.\n</think>\n\n<tool_call>\n'
            '{"name": "crm.lookup", "arguments": {"id": 3}}\n</tool_call>')
    with scripted(server, text):
        r = client.responses.create(model="tiny", input="Find 3", tools=[ns], max_output_tokens=80)
        events = _events(client, input="Find 3", tools=[ns], max_output_tokens=80)
    reasoning, call = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "\nNeed the record.\n"
    assert reasoning.summary == [] and r.usage.output_tokens_details.reasoning_tokens > 0
    assert (call.type, call.namespace, call.name) == ("function_call", "crm", "lookup")
    assert json.loads(call.arguments) == {"id": 3}
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert events[-1].response.output[1].namespace == "crm"
    forced = client.responses.create(model="tiny", input="Find 3", tools=[ns], max_output_tokens=20,
                                     tool_choice={"type": "function", "name": "lookup"})  # unqualified
    assert [(o.type, o.namespace, o.name) for o in forced.output] == [("function_call", "crm", "lookup")]


def test_parallel_tool_calls_false_keeps_one_call(client, server: LiveServer) -> None:
    with scripted(server, CALL + "\n" + CALL.replace("Oslo", "Lima")):
        both = client.responses.create(model="tiny", input="x", tools=[WEATHER], max_output_tokens=200)
        one = client.responses.create(model="tiny", input="x", tools=[WEATHER], max_output_tokens=200,
                                      parallel_tool_calls=False)
    assert [o.type for o in both.output] == ["function_call"] * 2 and both.status == "completed"
    assert [json.loads(o.arguments)["city"] for o in one.output] == ["Oslo"]


def test_codex_shaped_request(server: LiveServer, client) -> None:
    """The fields Codex CLI sends are accepted; the stream is what the SDK parses."""
    body = {"model": "tiny", "instructions": "You are a coding agent.", "stream": True, "store": False,
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
                      {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}],
                       "content": None, "encrypted_content": None},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]}],
            "tools": [{**WEATHER, "name": "shell"}, {"type": "local_shell"}, {"type": "custom", "name": "apply_patch"}],
            "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc", "text": {"verbosity": "medium"},
            "client_metadata": {"x": "y"}, "metadata": {"k": "v"}, "user": "u", "max_output_tokens": 6}
    with scripted(server, "Done."):
        with httpx.stream("POST", server.base_url + "/responses", json=body, timeout=60) as r:
            lines = [ln for ln in r.iter_lines() if ln]
    assert r.status_code == 200 and lines[0] == "event: response.created"
    last = json.loads(lines[-1].removeprefix("data: "))
    assert last["type"] == "response.completed" and last["response"]["output"][0]["content"][0]["text"] == "Done."
    with scripted(server, "Done."):
        with client.responses.stream(**{k: v for k, v in body.items() if k not in ("stream", "client_metadata")},
                                     extra_body={"client_metadata": {"x": "y"}}) as s:
            assert s.get_final_response().output_text == "Done."


def test_codex_cli_request_replayed(client, server: LiveServer) -> None:
    """Codex CLI 0.171's second request of a turn (developer instructions, namespace and hosted
    tools, a function_call and its output; captured through a logging proxy), replayed whole: the
    SDK parses the streamed tool call, whose name and arguments are the ones the model wrote."""
    body = json.loads(CODEX_REQUEST.read_text())
    assert [t["type"] for t in body["tools"]].count("namespace") == 1 and body["store"] is False
    rest = {k: v for k, v in body.items() if k not in ("model", "input", "stream")}
    text = '<tool_call>\n{"name": "multi_agent_v1.wait_agent", "arguments": {"timeout_ms": 10}}\n</tool_call>'
    with scripted(server, text):
        with client.responses.stream(model="tiny", input=body["input"], extra_body=rest) as s:
            final = s.get_final_response()
    call = final.output[-1]
    assert final.status == "completed" and final.usage.input_tokens > 10000
    assert (call.namespace, call.name) == ("multi_agent_v1", "wait_agent")
    assert json.loads(call.arguments) == {"timeout_ms": 10}


def test_stateful_fields_and_bad_items_are_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_123")
    err = e.value.body
    assert err["param"] == "previous_response_id" and "stores no responses" in err["message"]
    assert err["type"] == "invalid_request_error"
    bad = [([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]"),
           ([{"type": "item_reference", "id": "msg_1"}], "input[0]"),
           ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
           ([{"role": "robot", "content": "x"}], "input[0].role")]
    for items, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny", input=items)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="x", tools=HOSTED, tool_choice={"type": "web_search"})
    assert e.value.body["param"] == "tool_choice"


def test_store_true_keeps_nothing(client) -> None:
    r = client.responses.create(model="tiny", input="hi", store=True, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert "stores no responses" in e.value.body["message"]


def test_engine_failure_mid_stream_is_response_failed(tiny_model: Path) -> None:
    srv = start_server(str(tiny_model))
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
        delay_steps(srv, 0.05)
        stream = client.responses.create(model="tiny", input="Hi", max_output_tokens=200, stream=True)
        events = [next(stream), next(stream)]
        srv.loop.inject_fault(RuntimeError("simulated GPU fault"))
        events += list(stream)
        assert events[-1].type == "response.failed" and "simulated GPU fault" in events[-1].response.error.message
        assert [e.sequence_number for e in events] == list(range(len(events)))
    finally:
        delay_steps(srv, 0)
        srv.stop()


@pytest.fixture(scope="module")
def oss_server(harmony_model: Path) -> LiveServer:
    with serving(str(harmony_model), ServerConfig(served_model_names=["oss"]), script=ANSWER) as srv:
        yield srv


def test_gpt_oss_reasoning_item_and_call(oss_server: LiveServer) -> None:
    """gpt-oss (harmony): the analysis channel is a reasoning item, the commentary call a function_call."""
    client = openai.OpenAI(base_url=oss_server.base_url, api_key="x", max_retries=0, timeout=60)
    kw = dict(model="oss", input="Weather in Lima?", max_output_tokens=60, reasoning={"effort": "low"},
              tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}])
    r = client.responses.create(**kw)
    reasoning, call = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Need the weather tool."
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Lima"} and r.status == "completed"
    with client.responses.stream(**kw) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.reasoning_text.delta")
        final = s.get_final_response()
    assert deltas == reasoning.content[0].text and final.output[1].arguments == call.arguments
