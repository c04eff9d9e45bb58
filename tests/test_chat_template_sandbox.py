"""Chat templates under limits (server/template.py, server/chat.py), without a server: the bounded
sandbox renders as transformers does, refuses what would grow past its limit before building it,
stops runaway loops at the deadline; client templates need the server's trust."""

from __future__ import annotations

import time
import tracemalloc

import pytest
from jinja2.exceptions import SecurityError, TemplateError
from transformers import AutoTokenizer

from ferryman.llm import DEMO_MODEL
from ferryman.server.chat import ChatRenderer, RenderLimits
from ferryman.server.errors import APIError
from ferryman.server.template import BoundedSandbox, TemplateLimitError, deadline

# Qwen3-like: system + tools block, tool calls as JSON, tool responses grouped, loop controls
QWEN_LIKE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}{%- set ns = namespace(last_user=0) %}{%- for m in messages %}{% if m.role == 'user' %}\
{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}{%- for m in messages %}\
{%- if m.role == 'system' and loop.first %}{% continue %}{% endif %}\
{%- if m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ m.content | trim }}
</tool_response>{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}{%- else %}<|im_start|>{{ m.role }}
{{ m.content }}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson(indent=2) }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "read", "description": "read a file \u00e9",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list files \u2603"},
     {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                          "function": {"name": "read", "arguments": {"path": "a"}}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "  one\ntwo  "}, {"role": "tool", "content": "three"},
     {"role": "user", "content": "thanks"}],
]

HOSTILE = [
    "{{ 'x' * 200000000 }}",
    "{{ ['x'] * 200000000 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ 'x'|center(1000000000) }}",
    "{{ 'x'.ljust(1000000000) }}",
    "{{ 'ab'|indent(999999999) }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ 2 ** 100000000 }}",
    "{% set ns = namespace(x=7) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "{% set s = 'y' * 900000 %}{{ s|replace('', s) }}",
    "{% set s = 'y' * 900000 %}{{ [s, s] | join(s) }}",
    "{{ [('x' * 900000)] * 1000 }}",
    "{% set s = 'y' * 900000 %}{{ [s, s, s] }}",
]
LOOPS = [
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
    "{% set s = 'y' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(DEMO_MODEL))


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("template", ["demo", QWEN_LIKE])
def test_renders_as_transformers_does(tokenizer, conversation: list, tools: list | None, kwargs: dict,
                                      template: str) -> None:
    source = tokenizer.chat_template if template == "demo" else template
    if template == "demo":
        conversation = [m for m in conversation if m["role"] in ("system", "user")]
    want = tokenizer.apply_chat_template(conversation, tools=tools, chat_template=source, add_generation_prompt=True,
                                         tokenize=False, **kwargs)
    variables = {**tokenizer.special_tokens_map, **kwargs, "messages": conversation, "tools": tools,
                 "add_generation_prompt": True}
    assert BoundedSandbox(1 << 20).render(source, variables) == want


@pytest.mark.parametrize("template", HOSTILE)
def test_growth_past_the_limit_is_refused_before_it_is_built(template: str) -> None:
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TemplateLimitError, match="the limit is 1000000 characters"), deadline(5.0):
            BoundedSandbox(1_000_000).render(template, {})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - t0 < 2.0
    assert peak < 64 << 20, f"peak {peak >> 20} MiB"


@pytest.mark.parametrize("template", LOOPS)
def test_runaway_loops_stop_at_the_deadline(template: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match="ran for more than 0.3 s"), deadline(0.3):
        BoundedSandbox(1_000_000).render(template, {})
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("template, error", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", SecurityError),
    ("{% set l = [1] %}{{ l.append(2) }}", SecurityError),
    ("{{ raise_exception('no system role') }}", TemplateError),
    ("{{ lipsum(100000) }}", TemplateError),  # not there: it would build in code the deadline cannot stop
])
def test_the_sandbox_still_refuses_escapes_and_mutation(template: str, error: type) -> None:
    with pytest.raises(error):
        BoundedSandbox(1_000_000).render(template, {})


def test_client_templates_need_trust_and_name_their_field(tokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    strict = ChatRenderer(tokenizer)
    for kwargs, client, field in ((({"chat_template": "x"}), None, "chat_template_kwargs.chat_template"),
                                  (None, "x", "chat_template")):
        with pytest.raises(APIError) as e:
            strict.render(msgs, None, kwargs, client)
        assert e.value.status == 400 and e.value.param == field and "--trust-request-chat-template" in e.value.message
    trusted = ChatRenderer(tokenizer, RenderLimits(max_chars=4096, timeout_s=0.5, trust_client_template=True))
    assert trusted.render(msgs, None, None, "{{ messages[0].content }}!").text == "hi!"
    with pytest.raises(APIError) as e:
        trusted.render(msgs, None, None, "{% for i in range(100000) %}{{ i }}{% endfor %}")
    assert e.value.param == "chat_template" and "limit is 4096 characters" in e.value.message


def test_messages_are_checked_before_rendering(tokenizer) -> None:
    r = ChatRenderer(tokenizer, RenderLimits(max_chars=4096))
    cases = [([{"role": "user", "content": "x" * 5000}], None, "messages", "the conversation is"),
             ([{"role": "user", "content": "ok"}, {"role": "user", "content": "a\ud800"}], None,
              "messages[1].content", "lone surrogate"),
             ([{"role": "user", "content": "ok"}], {"tokenize": True}, "chat_template_kwargs.tokenize", "may not set"),
             ([{"role": "user", "content": "ok"}], {"x": "\udfff"}, "chat_template_kwargs.x", "lone surrogate")]
    for msgs, kwargs, field, words in cases:
        with pytest.raises(APIError) as e:
            r.render(msgs, None, kwargs)
        assert (e.value.status, e.value.param) == (400, field) and words in e.value.message, e.value.message
