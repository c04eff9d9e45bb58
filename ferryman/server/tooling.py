"""Tools, tool_choice and response_format -> what to render, which grammar, which parser.

  tool_choice auto (default)   tools rendered; the model decides; the output parser finds calls
  tool_choice none             tools not rendered, no calls parsed
  tool_choice required / any   grammar: `{"name": one of the tools, "arguments": its schema}`
  tool_choice a named function grammar: that function's parameter schema; the output is its arguments
  response_format json_*       grammar: the schema (json_object: any object); the output is content
Forced choices work with any model, since the grammar, not the model, guarantees the shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ferryman.server.chat import ChatPrompt
from ferryman.server.errors import APIError
from ferryman.server.grammar import GrammarMatcher
from ferryman.server.parsers import ForcedToolParser, OutputParser
from ferryman.server.state import ServerState


@dataclass
class ToolSetup:
    tools: list[dict[str, Any]] | None  # OpenAI-shape tools for the chat template
    grammar: Callable[[], GrammarMatcher] | None
    forced: Callable[[], OutputParser] | None  # parser of a grammar-forced output
    parse_tools: bool
    state: ServerState

    def parser_factory(self, prompt: ChatPrompt) -> Callable[[], OutputParser]:
        if self.forced is not None:
            return self.forced
        return lambda: self.state.make_parser(self.parse_tools, prompt)


def _call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t["function"]["name"]},
                               "arguments": t["function"].get("parameters") or {"type": "object"}}}
               for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _check_tools(st: ServerState, tools: list[dict[str, Any]], params: list[str]) -> None:
    """Every tool's parameter schema is a usable JSON schema, whether or not a grammar forces it:
    a 400 names the first bad one (`tools[i].function.parameters` or the API's own field)."""
    for t, param in zip(tools, params):
        schema = t["function"].get("parameters")
        if schema is not None:
            st.grammars.check_schema(schema, param)


def tool_setup(st: ServerState, tools: list[dict[str, Any]] | None, choice: str | None,
               json_schema: dict[str, Any] | None = None, format_param: str = "response_format",
               tool_params: list[str] | None = None) -> ToolSetup:
    """choice: None / "auto" / "none" / "required" or "function:NAME". tool_params: the request
    field of each tool's schema (default OpenAI's `tools[i].function.parameters`). Each schema is
    compiled once per request; the request's choices sample through copies of it."""
    if choice not in (None, "auto", "none") and not tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if json_schema is not None and choice not in (None, "auto", "none"):
        raise APIError(400, f"{format_param} cannot be combined with a forced tool_choice", format_param)
    params = tool_params or [f"tools[{i}].function.parameters" for i in range(len(tools or []))]
    _check_tools(st, tools or [], params)
    if json_schema is not None:
        grammar = st.grammars.compile(json_schema, format_param).matcher
        return ToolSetup(tools if choice != "none" else None, grammar, None, False, st)
    if not tools or choice == "none":
        return ToolSetup(None, None, None, False, st)
    if choice == "required":
        grammar = st.grammars.compile(_call_schema(tools), "tools", lenient=True).matcher
        return ToolSetup(tools, grammar, ForcedToolParser, True, st)
    if choice is not None and choice.startswith("function:"):
        name = choice.removeprefix("function:")
        i = next((i for i, t in enumerate(tools) if t["function"]["name"] == name), None)
        if i is None:
            raise APIError(400, f"tool_choice names '{name}', which is not among the tools", "tool_choice")
        schema = tools[i]["function"].get("parameters") or {"type": "object"}
        grammar = st.grammars.compile(schema, params[i], lenient=True).matcher
        return ToolSetup(tools, grammar, lambda: ForcedToolParser(name), True, st)
    return ToolSetup(tools, None, None, True, st)
