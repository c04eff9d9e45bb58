"""OpenAI API against a live server (uvicorn on 127.0.0.1), through the official `openai` client."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from ferryman import LLM, SamplingParams  # noqa: E402
from server_harness import LiveServer, scripted, start_server  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}


@pytest.fixture(scope="module")
def client(server: LiveServer) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _chat(client, content: str, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


def test_models(client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_matches_offline_engine(client, tiny_model: Path, server: LiveServer) -> None:
    """The server's greedy answer is the offline LLM's greedy answer on the chat template's ids."""
    r = _chat(client, "Write a haiku.", max_tokens=12, temperature=0)
    llm = LLM(str(tiny_model), device="cpu", dtype="float32")
    ids = llm.chat_ids([{"role": "user", "content": "Write a haiku."}])
    want = llm.generate(prompt_token_ids=[ids], params=SamplingParams(temperature=0, max_tokens=12))[0]
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids)
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")


def test_chat_stream_equals_whole(client) -> None:
    whole = _chat(client, "Tell me more.", max_tokens=10, temperature=0)
    chunks = list(_chat(client, "Tell me more.", max_tokens=10, temperature=0, stream=True,
                        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_completions_logprobs_and_seeded_n(client) -> None:
    r = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 and "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen == pytest.approx(max(top.values()))  # greedy picks the top token
    kw = dict(model="tiny", prompt="import os", max_tokens=8, temperature=1.0, seed=7, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # seed + i per choice


def test_stop_string(client) -> None:
    free = _chat(client, "Go on.", max_tokens=12, temperature=0).choices[0].message.content
    stop = free[3:6]
    cut = _chat(client, "Go on.", max_tokens=12, temperature=0, stop=[stop]).choices[0]
    assert cut.message.content == free[:free.index(stop)] and cut.finish_reason == "stop"


def test_chat_logprobs(client) -> None:
    r = _chat(client, "hi", max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content


def test_json_schema_output_parses(client) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
              "properties": {"name": {"type": "string", "maxLength": 6},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                             "ok": {"type": "boolean"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    for seed in (0, 1):
        r = _chat(client, "A person as JSON.", max_tokens=40, temperature=1.0, seed=seed, response_format=fmt)
        obj = json.loads(r.choices[0].message.content)
        assert set(obj) == {"name", "age", "ok"} and 0 <= obj["age"] <= 120 and len(obj["name"]) <= 6
        assert r.choices[0].finish_reason == "stop"


def test_tools_round_trip(client) -> None:
    msgs = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], max_tokens=40,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Oslo", "Lima")
    assert r.choices[0].finish_reason == "tool_calls"
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}]
    r2 = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], max_tokens=5, temperature=0)
    assert r2.choices[0].message.role == "assistant" and r2.usage.prompt_tokens > r.usage.prompt_tokens
    required = client.chat.completions.create(model="tiny", messages=msgs[:1], tools=[WEATHER],
                                              tool_choice="required", max_tokens=40, temperature=0)
    assert required.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_parsed_reasoning_and_tool_call(client, server: LiveServer) -> None:
    """A scripted output in Qwen3 markup comes back as reasoning_content + tool_calls (whole and streamed)."""
    text = ('<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>')
    with scripted(server, text):
        r = _chat(client, "Weather?", tools=[WEATHER], max_tokens=80)
        chunks = list(_chat(client, "Weather?", tools=[WEATHER], max_tokens=80, stream=True))
    msg = r.choices[0].message
    assert msg.reasoning_content == "\nThe user wants weather.\n" and not msg.content
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Oslo", "days": 3}
    assert r.choices[0].finish_reason == "tool_calls"
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert streamed == msg.reasoning_content and calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_concurrent_greedy_equals_sequential(client) -> None:
    prompts = [f"Question number {i}: what is {i} * {i + 3}?" for i in range(32)]

    def ask(p: str) -> str:
        return _chat(client, p, max_tokens=12, temperature=0).choices[0].message.content

    sequential = [ask(p) for p in prompts]
    with ThreadPoolExecutor(32) as pool:
        concurrent = list(pool.map(ask, prompts))
    assert concurrent == sequential


def test_second_agent_turn_prefills_only_the_tail(client) -> None:
    system = "You are a coding agent. " + " ".join(f"Rule {i}: be precise." for i in range(30))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "List the files."}]
    first = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Now open the first one."}]
    second = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    block = 16
    # everything of turn one that fills whole KV blocks is reused; only the tail is computed
    assert cached >= (first.usage.prompt_tokens // block) * block
    assert second.usage.prompt_tokens - cached < (second.usage.prompt_tokens - first.usage.prompt_tokens) + block


def test_long_prefill_does_not_freeze_streams(tiny_model: Path) -> None:
    """A 480-token prompt is prefilled in 32-token chunks mixed into decode steps: a running
    stream keeps getting tokens while it is prefilled."""
    import threading
    import time

    from server_harness import delay_steps

    srv = start_server(str(tiny_model), max_num_batched_tokens=32)
    try:
        delay_steps(srv, 0.01)
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
        arrivals: list[float] = []
        stream = client.completions.create(model="tiny", prompt="x = 1", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        reader = threading.Thread(target=lambda: [arrivals.append(time.monotonic()) for _ in it])
        reader.start()
        sent = time.monotonic()
        long = client.completions.create(model="tiny", prompt=list(range(100, 580)), max_tokens=1)
        done = time.monotonic()
        reader.join(30)
        assert long.usage.prompt_tokens == 480
        during = [t for t in arrivals if sent < t < done]
        assert len(during) >= 10, f"only {len(during)} stream tokens during a 15-chunk prefill"
    finally:
        srv.stop()


def test_logprobs_match_transformers(client, tiny_model: Path) -> None:
    """Logprobs of the generated tokens and the top-3 equal log_softmax of transformers' own logits."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 42, 7, 99, 1000, 2000]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    lp = r.choices[0].logprobs
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    tok_ids = out[0, len(prompt):].tolist()
    with torch.no_grad():
        logp = ref(torch.tensor([prompt + tok_ids])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    for i, t in enumerate(tok_ids):
        assert lp.token_logprobs[i] == pytest.approx(logp[i, t].item(), abs=1e-4)
        top = logp[i].topk(3).values.tolist()
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(top, abs=1e-4)


def test_n_choices_and_prompt_batches(client) -> None:
    r = client.completions.create(model="tiny", prompt=["a = 1", "b = 2"], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text  # greedy
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 n=2, max_tokens=4, temperature=0, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    whole = _chat(client, "hi", max_tokens=4, temperature=0).choices[0].message.content
    assert texts == {0: whole, 1: whole}


def test_image_parts_are_rejected(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert e.value.body["param"] == "messages[0].content[0].type"
