"""Request bodies of the OpenAI and Anthropic APIs (pydantic). Unknown fields are ignored;
a wrong type or value is a 400 naming the field. Responses are plain dicts built by the routes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- OpenAI ----------------------------------------------------------------------------------
class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)  # extension (vLLM)
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # extension
    repetition_penalty: float = Field(1.0, gt=0.0)  # extension
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension: benchmarks need fixed output lengths
    logit_bias: dict[str, Any] | None = None  # token id (as text) -> bias in [-100, 100]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension, e.g. {"enable_thinking": false}
    chat_template: str | None = None  # extension: refused unless --trust-request-chat-template


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)  # None: the server's default, else 16 as OpenAI
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


# ---- Anthropic (text blocks are TextParts) -----------------------------------------------------
class AImageBlock(_Body):
    type: Literal["image", "document"]


class AToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class AToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextPart] = ""
    is_error: bool = False


class AThinkingBlock(_Body):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""
    signature: str | None = None


ABlock = Annotated[TextPart | AImageBlock | AToolUseBlock | AToolResultBlock | AThinkingBlock,
                   Field(discriminator="type")]


class AMessage(_Body):
    role: Literal["user", "assistant", "system"]  # system: an instruction from this point on (beta
    content: str | list[ABlock]  # mid-conversation-system-2026-04-07); its content is text


class ATool(_Body):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class AToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class AThinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class AJsonFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class AOutputConfig(_Body):
    format: AJsonFormat | None = None  # structured output


class ACountTokensRequest(_Body):
    model: str
    messages: list[AMessage] = Field(min_length=1)
    system: str | list[TextPart] | None = None
    tools: list[ATool] | None = None
    tool_choice: AToolChoice | None = None
    thinking: AThinking | None = None
    output_config: AOutputConfig | None = None


class AMessagesRequest(ACountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: Any = None  # not in this API: present, it is refused by name (one message per request)
