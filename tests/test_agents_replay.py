"""The first requests of four coding agents, replayed against a live server and read back through
the official SDKs, as the agents' own clients read them.

tests/fixtures/agents/<agent>/NN.json were captured once through tools/agents_proxy.py (Claude
Code 2.1.197, Codex CLI 0.171.0, opencode 1.18.33, Qwen Code 0.15.10; `tools/agents_check.sh`
runs the agents themselves). Each is sent as captured (path, headers, body: tools, system
prompts, betas) but with its output budget cut to a few tokens: the prompts are 9k-20k tokens and
the replies of a random model are not the point. Every event of a stream must validate strictly
against the SDK's own types, and the SDK's accumulator must build the final message from them.
"""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from anthropic.lib.streaming import BetaMessageStream  # noqa: E402
from anthropic.types.beta import BetaMessage, BetaRawMessageStreamEvent  # noqa: E402
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

from ferryman.server import ServerConfig  # noqa: E402
from server_harness import LiveServer, build_tiny_chat_model, start_server  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
CASES = sorted(FIXTURES.glob("*/[0-9][0-9].json"))
OUTPUT_CAP = 8  # output tokens per replay: each field an agent uses for its budget is set to this
BUDGET_FIELDS = {"/v1/messages": "max_tokens", "/v1/chat/completions": "max_tokens",
                 "/v1/responses": "max_output_tokens"}
SDK_HEADERS = {"content-type", "accept", "user-agent"}  # the SDK sets its own


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    """The tiny chat model with room for an agent's prompt (20k tokens) and the demo tokenizer."""
    model = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-32k"), max_positions=32768, heads=(1, 1))
    srv = start_server(str(model), ServerConfig(served_model_names=["demo-moe"]),  # the name the agents used
                       max_num_seqs=2, max_num_batched_tokens=4096)
    yield srv
    srv.stop()


def load_case(path: Path) -> tuple[str, dict[str, Any], dict[str, str], dict[str, Any]]:
    """(route, query params, headers, body with the output budget cut)."""
    case = json.loads(path.read_text())
    url = urlsplit(case["path"])
    body = dict(case["body"])
    field = BUDGET_FIELDS[url.path]
    body[field] = min(body.get(field) or OUTPUT_CAP, OUTPUT_CAP)
    headers = {k: v for k, v in case["headers"].items() if k not in SDK_HEADERS}
    return url.path, dict(parse_qsl(url.query)), headers, body


def event_types(union: Any) -> dict[str, type]:
    """{event type name: SDK class} of a discriminated union of stream events."""
    members = typing.get_args(typing.get_args(union)[0])
    return {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in members}


ANTHROPIC_EVENTS = event_types(BetaRawMessageStreamEvent)
RESPONSES_EVENTS = event_types(ResponseStreamEvent)


def strict(obj: Any, cls: type | None = None) -> Any:
    """`obj` validated against its SDK type (or `cls`), required fields and all: the SDK's stream
    only constructs models, so a missing field would go unnoticed there."""
    return (cls or type(obj)).model_validate(obj.to_dict(mode="json"))


def sdk_post(client: Any, path: str, cast: type, stream_cls: type, params: dict, headers: dict, body: dict) -> Any:
    """POST the agent's body, query and headers through the SDK's client: the response validated
    strictly as `cast`, or, when the body streams, the SDK's stream of `stream_cls`."""
    opts = {"params": params, "headers": headers}
    if not body.get("stream"):
        return strict(client.post(path, cast_to=cast, body=body, options=opts))
    return client.post(path, cast_to=cast, body=body, options=opts, stream=True, stream_cls=stream_cls)


def openai_client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)


def replay_messages(srv: LiveServer, params: dict, headers: dict, body: dict) -> BetaMessage:
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=300)
    out = sdk_post(client, "/v1/messages", BetaMessage, anthropic.Stream[BetaRawMessageStreamEvent], params,
                   headers, body)
    if not body.get("stream"):
        return out
    stream = BetaMessageStream(out, anthropic.NOT_GIVEN)
    kinds = [strict(e, ANTHROPIC_EVENTS[e.type]).type for e in stream if e.type != "text"]  # "text": the SDK's own
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    return stream.get_final_message()


def replay_chat(srv: LiveServer, params: dict, headers: dict, body: dict) -> ChatCompletion:
    out = sdk_post(openai_client(srv), "/chat/completions", ChatCompletion, openai.Stream[ChatCompletionChunk],
                   params, headers, body)
    if not body.get("stream"):
        return out
    state = ChatCompletionStreamState()
    chunks = [strict(c) for c in out]
    for chunk in chunks:
        state.handle_chunk(chunk)
    if body.get("stream_options", {}).get("include_usage"):
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    # the snapshot, not get_final_completion(): that one is for .parse() and refuses "length"
    return strict(state.current_completion_snapshot, ChatCompletion)


def replay_responses(srv: LiveServer, params: dict, headers: dict, body: dict) -> Response:
    out = sdk_post(openai_client(srv), "/responses", Response, openai.Stream[ResponseStreamEvent], params, headers,
                   body)
    if not body.get("stream"):
        return out
    events = [strict(e, RESPONSES_EVENTS[e.type]) for e in out]
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
    first = events[0].sequence_number
    assert [e.sequence_number for e in events] == list(range(first, first + len(events)))
    return events[-1].response


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_agent_request_replays(agent_server: LiveServer, case: Path) -> None:
    route, params, headers, body = load_case(case)
    if route == "/v1/messages":
        msg = replay_messages(agent_server, params, headers, body)
        assert msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
        assert 1 <= msg.usage.output_tokens <= OUTPUT_CAP
        assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 1000
    elif route == "/v1/chat/completions":
        done = replay_chat(agent_server, params, headers, body)
        assert done.choices[0].message.role == "assistant"
        assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    else:
        resp = replay_responses(agent_server, params, headers, body)
        assert resp.status in ("completed", "incomplete") and resp.output
        assert resp.usage is not None and 1 <= resp.usage.output_tokens <= OUTPUT_CAP
        assert resp.usage.input_tokens > 1000
    assert agent_server.loop.alive, "the engine loop died during the replay"


def test_fixtures_are_scrubbed_and_small() -> None:
    """Captured requests carry no home path, user or machine id, and stay small in the repo."""
    assert {p.parent.name for p in CASES} == {"claude-code", "codex", "opencode", "qwen-code"}
    total = 0
    for path in CASES:
        text = path.read_text()
        total += len(text.encode())
        case = json.loads(text)
        assert case["method"] == "POST" and urlsplit(case["path"]).path in BUDGET_FIELDS
        assert not {"authorization", "x-api-key"} & set(case["headers"])
        homes = set(re.findall(r"/(?:home|Users)/([\w.-]+)", text)) | set(re.findall(r"/root/[\w.-]+", text))
        assert homes <= {"user", "name"}, f"{path}: home paths {homes}"  # "name": opencode's own example
    assert total < 2 * 1024 * 1024
