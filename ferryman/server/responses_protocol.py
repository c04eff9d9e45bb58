"""OpenAI Responses API requests -> the chat pipeline's inputs: messages, tools, tool_choice.

`input` items map onto chat messages (the shape `ChatRenderer.render` takes):

  message developer / system     system message (those at the start, with `instructions`, merged)
  message user / assistant       user / assistant message (text parts joined)
  function_call                  a tool call of the assistant message it follows (or a new one)
  function_call_output           tool message
  reasoning                      `reasoning_content` of the next assistant message (and
                                 `thinking`, gpt-oss's name, when that message has no text)
  custom_tool_call(_output)      as function calls, the input as `{"input": ...}`
  item_reference                 400: nothing is stored, so nothing can be referenced
  other types (hosted tool calls, compaction, ...)  skipped: only OpenAI's servers can replay them

Tools: `function` tools and the functions of `namespace` tools (named `NAMESPACE.NAME` for the
model, returned as `name` + `namespace`) are offered; hosted tools (web_search, file_search, mcp,
...) and custom tools are declined: left out of the prompt, the request still runs.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ferryman.server.errors import APIError, validation_error


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Model):
    """POST /v1/responses. Fields OpenAI defines that change nothing here (`store`, `include`,
    `metadata`, `user`, `prompt_cache_key`, `client_metadata`, `service_tier`, `truncation`,
    `safety_identifier`, ...) are accepted."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None


# ---- input items ------------------------------------------------------------------------------
class ContentPart(_Model):
    type: str
    text: str | None = None
    refusal: str | None = None  # of a `refusal` part

    @property
    def value(self) -> str | None:
        return self.refusal if self.type == "refusal" else self.text


class MessageItem(_Model):
    role: Literal["developer", "system", "user", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(_Model):
    call_id: str
    name: str
    arguments: str = "{}"
    namespace: str | None = None


class CustomToolCallItem(_Model):
    call_id: str
    name: str
    input: str = ""
    namespace: str | None = None


class ToolOutputItem(_Model):
    call_id: str
    output: str | list[ContentPart] = ""


class ReasoningItem(_Model):
    summary: list[ContentPart] = Field(default_factory=list)
    content: list[ContentPart] | None = None


class FunctionTool(_Model):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(_Model):
    name: str = Field(min_length=1, max_length=128)
    description: str = ""
    tools: list[dict[str, Any]]


M = TypeVar("M", bound=BaseModel)
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")


def validate(model: type[M], data: Any, *where: str | int) -> M:
    """`data` as `model`, or a 400 naming the field under `where` (e.g. "input", 3)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error([{**err, "loc": (*where, *err["loc"])} for err in e.errors()]) from None


def parts_text(content: str | list[ContentPart], param: str) -> str:
    """Text of a content field; a non-text part (image, file, audio) is a 400 naming it."""
    if isinstance(content, str):
        return content
    for j, p in enumerate(content):
        if p.type not in _TEXT_PARTS or p.value is None:
            raise APIError(400, f"{p.type} content is not supported by this server", f"{param}[{j}]")
    return "".join(p.value or "" for p in content)


def flat_name(namespace: str | None, name: str) -> str:
    return f"{namespace}.{name}" if namespace else name


class _Conversation:
    """Builds chat messages item by item (see the module docstring)."""

    def __init__(self, instructions: str | None) -> None:
        self.messages: list[dict[str, Any]] = []
        self.reasoning = ""  # of the next assistant message
        if instructions:
            self.messages.append({"role": "system", "content": instructions})

    def add(self, raw: dict[str, Any], i: int) -> None:
        kind = raw.get("type") or "message"  # an easy input message has no type
        where = ("input", i)
        if kind == "message":
            m = validate(MessageItem, raw, *where)
            self._message(m.role, parts_text(m.content, f"input[{i}].content"))
        elif kind in ("function_call", "custom_tool_call"):
            fc = validate(FunctionCallItem if kind == "function_call" else CustomToolCallItem, raw, *where)
            args = fc.arguments if isinstance(fc, FunctionCallItem) else json.dumps({"input": fc.input})
            self._call(fc.call_id, flat_name(fc.namespace, fc.name), args)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out = validate(ToolOutputItem, raw, *where)
            content = parts_text(out.output, f"input[{i}].output")
            self.messages.append({"role": "tool", "tool_call_id": out.call_id, "content": content})
        elif kind == "reasoning":
            r = validate(ReasoningItem, raw, *where)
            self.reasoning += parts_text(r.content if r.content else r.summary, f"input[{i}].content")
        elif kind == "item_reference":
            raise APIError(400, "item_reference is not supported: this server stores no items; "
                                "send the items themselves", f"input[{i}]")

    def _message(self, role: str, text: str) -> None:
        if role in ("developer", "system"):
            if self.messages and all(m["role"] == "system" for m in self.messages):
                self.messages[-1]["content"] += "\n\n" + text  # one system message at the start
            else:
                self.messages.append({"role": "system", "content": text})
        elif role == "assistant":
            last = self._assistant(new=bool(self.messages and self.messages[-1].get("tool_calls")))
            last["content"] += text
        else:
            self.messages.append({"role": role, "content": text})

    def _assistant(self, new: bool = False) -> dict[str, Any]:
        """The assistant message being built (a new one after any other message)."""
        if new or not self.messages or self.messages[-1]["role"] != "assistant":
            self.messages.append({"role": "assistant", "content": ""})
        msg = self.messages[-1]
        if self.reasoning:
            msg["reasoning_content"], self.reasoning = msg.get("reasoning_content", "") + self.reasoning, ""
        return msg

    def _call(self, call_id: str, name: str, arguments: str) -> None:
        msg = self._assistant()
        msg.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})


def conversation(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `instructions` and `input` as chat messages."""
    conv = _Conversation(body.instructions)
    if isinstance(body.input, str):
        conv.messages.append({"role": "user", "content": body.input})
    else:
        for i, raw in enumerate(body.input):
            conv.add(raw, i)
    if not any(m["role"] != "system" for m in conv.messages):
        raise APIError(400, "input has no message to answer", "input")
    for m in conv.messages:  # gpt-oss templates read a tool-calling turn's reasoning as `thinking`
        if m.get("reasoning_content") and not m["content"]:
            m["thinking"] = m["reasoning_content"]
    return conv.messages


# ---- tools ------------------------------------------------------------------------------------
def _chat_tool(fn: FunctionTool, name: str, description: str) -> dict[str, Any]:
    params = fn.parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


ToolNames = dict[str, tuple[str | None, str]]  # the name the model sees -> (namespace, function name)


def function_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], ToolNames]:
    """Chat-shape tools for the template and, per name the model sees, (namespace, name)."""
    out: list[dict[str, Any]] = []
    names: ToolNames = {}

    def add(fn: FunctionTool, namespace: str | None, description: str, param: str) -> None:
        name = flat_name(namespace, fn.name)
        if name in names:
            raise APIError(400, f"two tools are named '{name}'", param)
        names[name] = (namespace, fn.name)
        out.append(_chat_tool(fn, name, description))

    for i, t in enumerate(tools or []):
        kind = t.get("type")
        if kind == "function":
            fn = validate(FunctionTool, t, "tools", i)
            add(fn, None, fn.description or "", f"tools[{i}].name")
        elif kind == "namespace":
            ns = validate(NamespaceTool, t, "tools", i)
            for j, inner in enumerate(ns.tools):
                if inner.get("type") == "function":
                    fn = validate(FunctionTool, inner, "tools", i, "tools", j)
                    desc = "\n\n".join(d for d in (ns.description, fn.description or "") if d)
                    add(fn, ns.name, desc, f"tools[{i}].tools[{j}].name")
    return out, names


def tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]],
                names: ToolNames) -> tuple[str | None, list[dict[str, Any]]]:
    """Responses tool_choice -> (tooling's choice: None / auto / none / required / function:NAME,
    the tools to offer)."""
    if choice is None or isinstance(choice, str):
        return choice, tools
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise APIError(400, "tool_choice.name is required when tool_choice.type is 'function'", "tool_choice.name")
        name = flat_name(choice.get("namespace"), name)
        if name not in names:  # an unqualified name of a namespace's function
            name = next((flat for flat, (_, n) in names.items() if n == name), name)
        return "function:" + name, tools
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise APIError(400, f"tool_choice.mode must be 'auto' or 'required', got {mode!r}", "tool_choice.mode")
        allowed = {flat_name(t.get("namespace"), t.get("name", "")) for t in choice.get("tools") or []
                   if isinstance(t, dict) and t.get("type") == "function"}
        return mode, [t for t in tools if t["function"]["name"] in allowed]
    raise APIError(400, f"tool_choice forces the tool type {kind!r}, which this server does not run "
                        "(it runs function tools only)", "tool_choice")


def json_schema(text: TextConfig | None) -> dict[str, Any] | None:
    """The schema text.format asks for (json_object: any object), else None."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.schema_ is None:
        raise APIError(400, "text.format.schema is required for type json_schema", "text.format.schema")
    return fmt.schema_
