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


def _compile(st: ServerState, schema: dict[str, Any], param: str) -> Callable[[], GrammarMatcher]:
    st.grammars.json_schema(schema, param)  # fail now (400), not in the engine thread
    return lambda: st.grammars.json_schema(schema, param)


def _call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t["function"]["name"]},
                               "arguments": t["function"].get("parameters") or {"type": "object"}}}
               for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_setup(st: ServerState, tools: list[dict[str, Any]] | None, choice: str | None,
               json_schema: dict[str, Any] | None = None, format_param: str = "response_format") -> ToolSetup:
    """choice: None / "auto" / "none" / "required" or "function:NAME"."""
    if choice not in (None, "auto", "none") and not tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if json_schema is not None and choice not in (None, "auto", "none"):
        raise APIError(400, f"{format_param} cannot be combined with a forced tool_choice", format_param)
    if json_schema is not None:
        return ToolSetup(tools if choice != "none" else None, _compile(st, json_schema, format_param),
                         None, False, st)
    if not tools or choice == "none":
        return ToolSetup(None, None, None, False, st)
    if choice == "required":
        return ToolSetup(tools, _compile(st, _call_schema(tools), "tool_choice"), ForcedToolParser, True, st)
    if choice is not None and choice.startswith("function:"):
        name = choice.removeprefix("function:")
        fn = next((t["function"] for t in tools if t["function"]["name"] == name), None)
        if fn is None:
            raise APIError(400, f"tool_choice names '{name}', which is not among the tools", "tool_choice")
        schema = fn.get("parameters") or {"type": "object"}
        return ToolSetup(tools, _compile(st, schema, "tool_choice"), lambda: ForcedToolParser(name), True, st)
    return ToolSetup(tools, None, None, True, st)
