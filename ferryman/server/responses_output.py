"""Parsed model output -> Responses API output items, and the stream events that build them.

One writer serves both ways of answering: fed the whole output once (the events are dropped) or
delta by delta while streaming. Its `items` are what the final Response object lists, so a client
that rebuilds the response from the events gets the same items, ids included.

  reasoning text   a `reasoning` item: content [reasoning_text] (no summary: nothing summarises)
  content text     a `message` item: content [output_text]
  a tool call      a `function_call` item (`namespace` set for a namespace tool's function)

Events per item: output_item.added, (content_part.added, *_text.delta..., *_text.done,
content_part.done | function_call_arguments.delta, .done), output_item.done; each event carries
the response's next `sequence_number`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ferryman.server.generation import sse
from ferryman.server.parsers import Parsed, ToolCall
from ferryman.server.responses_protocol import ToolNames

# kind -> (delta event prefix, content part type)
_TEXT_KINDS = {"reasoning": ("response.reasoning_text", "reasoning_text"),
               "message": ("response.output_text", "output_text")}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part(kind: str, text: str) -> dict[str, Any]:
    part: dict[str, Any] = {"type": _TEXT_KINDS[kind][1], "text": text}
    if kind == "message":
        part.update(annotations=[], logprobs=[])
    return part


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


class OutputWriter:
    """Output items and their stream events, fed parsed deltas in order."""

    def __init__(self, names: ToolNames, parallel_tool_calls: bool,
                 forced_tool: bool) -> None:
        self.names = names  # the name the model calls -> (namespace, function name)
        self.parallel = parallel_tool_calls
        self.forced_tool = forced_tool  # the output is a grammar-forced call: never message text
        self.items: list[dict[str, Any]] = []  # output items, done or (the last one) open
        self.open: dict[str, Any] | None = None  # the reasoning / message item being written
        self.seq = 0
        self.calls = 0

    def event(self, kind: str, **fields: Any) -> str:
        ev = sse({"type": kind, **fields, "sequence_number": self.seq}, kind)
        self.seq += 1
        return ev

    def feed(self, parsed: Parsed, finish_reason: str | None) -> list[str]:
        """Events of one delta; `finish_reason` set on the last one."""
        cut = finish_reason == "length"
        events: list[str] = []
        if parsed.reasoning:
            events += self._text("reasoning", parsed.reasoning)
        if parsed.content and not (self.forced_tool and cut):  # a cut forced call is no message
            events += self._text("message", parsed.content)
        for call in parsed.tool_calls:
            if self.parallel or self.calls == 0:
                events += self._call(call, complete=not cut or is_json_object(call.arguments))
        return events

    def close(self, incomplete: bool) -> list[str]:
        """Finish the open item (status incomplete when the output was cut in it)."""
        item, self.open = self.open, None
        if item is None:
            return []
        kind = item["type"]
        text = item["content"][0]["text"]
        item["status"] = "incomplete" if incomplete else "completed"
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        done = {"text": text, "logprobs": []} if kind == "message" else {"text": text}
        return [self.event(_TEXT_KINDS[kind][0] + ".done", **where, content_index=0, **done),
                self.event("response.content_part.done", **where, content_index=0, part=_part(kind, text)),
                self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    # ---- items -----------------------------------------------------------------------------------
    def _add(self, item: dict[str, Any]) -> list[str]:
        events = self.close(False)
        self.items.append(item)
        added = {**item, "status": "in_progress"}
        if item["type"] in _TEXT_KINDS:
            added["content"] = []
        elif item["type"] == "function_call":
            added["arguments"] = ""
        return events + [self.event("response.output_item.added", output_index=len(self.items) - 1, item=added)]

    def _text(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        if self.open is None or self.open["type"] != kind:
            item_id = _new_id("rs" if kind == "reasoning" else "msg")
            item: dict[str, Any] = {"id": item_id, "type": kind, "status": "in_progress", "content": [_part(kind, "")]}
            item.update({"summary": []} if kind == "reasoning" else {"role": "assistant"})
            events += self._add(item)
            self.open = item
            events.append(self.event("response.content_part.added", item_id=item_id, output_index=len(self.items) - 1,
                                     content_index=0, part=_part(kind, "")))
        self.open["content"][0]["text"] += text
        delta: dict[str, Any] = {"delta": text, "logprobs": []} if kind == "message" else {"delta": text}
        return events + [self.event(_TEXT_KINDS[kind][0] + ".delta", item_id=self.open["id"],
                                    output_index=len(self.items) - 1, content_index=0, **delta)]

    def _call(self, call: ToolCall, complete: bool) -> list[str]:
        """A whole tool call; one cut by the token limit (arguments not JSON) is `incomplete`."""
        self.calls += 1
        namespace, name = self.names.get(call.name, (None, call.name))
        item: dict[str, Any] = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                                "call_id": call.id, "name": name, "arguments": call.arguments}
        if namespace is not None:
            item["namespace"] = namespace
        events = self._add(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        item["status"] = "completed" if complete else "incomplete"
        return events + [self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
                         self.event("response.function_call_arguments.done", **where, name=name,
                                    arguments=call.arguments),
                         self.event("response.output_item.done", output_index=where["output_index"], item=item)]
