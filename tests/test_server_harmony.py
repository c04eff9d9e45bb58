"""gpt-oss through the server: harmony output (special-token markup) -> reasoning_content and tool calls.

A tiny random gpt_oss (transformers-built, dense experts) gets the demo tokenizer plus the harmony
special tokens and a minimal harmony chat template; a scripted logits processor makes it write a
harmony answer, so the parser is exercised on real engine token ids through the real API paths.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")

from ferryman.llm import DEMO_MODEL  # noqa: E402
from ferryman.server import ServerConfig  # noqa: E402
from ferryman.server.harmony import MARKERS  # noqa: E402
from server_harness import LiveServer, serving  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "<|start|>assistant")
ANSWER = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
          "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
          '{"city":"Lima"}<|call|>')


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-gpt-oss")
    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    tok.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    ids = tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "gpt_oss", vocab_size=8256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=32, sliding_window=8, eos_token_id=ids, pad_token_id=0,
        tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(harmony_model: Path) -> LiveServer:
    with serving(str(harmony_model), ServerConfig(served_model_names=["oss"]), script=ANSWER) as srv:
        yield srv


def test_harmony_parser_is_chosen(server: LiveServer) -> None:
    assert server.app.state.ferryman.parser_kind == "harmony"


def test_harmony_tool_call_and_reasoning(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    kw = dict(model="oss", messages=[{"role": "user", "content": "Weather in Lima?"}], tools=tools, max_tokens=60)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.reasoning_content == "Need the weather tool." and not msg.content
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Lima"}
    assert r.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**kw, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert reasoning == msg.reasoning_content and calls[0].function.arguments == msg.tool_calls[0].function.arguments
