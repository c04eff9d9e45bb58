"""gpt-oss output parser for the harmony format, written from the format spec.

openai-harmony is not used: its encodings are downloaded at run time, which ferryman never does.
Harmony markup is made of special tokens, which text detokenisation drops, so this parser works
on token ids. After a prompt ending in `<|start|>assistant`, the model writes messages:

    <|channel|>analysis<|message|>...<|end|>                     reasoning
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>...<|return|>   the answer

A header (the text between `<|start|>` and `<|message|>`) names the channel and, for a tool call,
the recipient `to=functions.NAME` (which may also stand before `<|channel|>`). `analysis` is
returned as reasoning, `final` and recipient-less `commentary` as content, and a message to
`functions.NAME` becomes a tool call. Output without any markup is content.
"""

from __future__ import annotations

import re
from typing import Any

from ferryman.server.parsers import OutputParser, Parsed, ToolCall

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


def harmony_marker_ids(tokenizer: Any) -> dict[int, str] | None:
    """Token id -> marker for a tokenizer that has the harmony special tokens, else None."""
    ids = {}
    for m in MARKERS:
        tid = tokenizer.convert_tokens_to_ids(m)
        if tid is None or tid == tokenizer.unk_token_id:
            return None
        ids[int(tid)] = m
    return ids


class HarmonyParser(OutputParser):
    def __init__(self, tokenizer: Any, markers: dict[int, str]) -> None:
        self.tokenizer = tokenizer
        self.markers = markers
        self.mode = "header"  # header | body | between
        self.header = ""  # markers and text of the current header
        self.body_ids: list[int] = []  # tokens of the current message body
        self.body_emitted = 0  # characters of the body's text already returned
        self.channel = ""
        self.recipient: str | None = None
        self.saw_message = False

    def feed(self, token_ids: list[int], text: str) -> Parsed:
        out = Parsed()
        for t in token_ids:
            marker = self.markers.get(t)
            if marker is None:
                self._text_token(t, out)
            else:
                self._marker(marker, out)
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self.mode == "body":
            self._emit_body(out, final=True)
            self._close_message(out)
        elif self.mode == "header" and not self.saw_message:
            out.content += self.header  # no markup at all: plain text
        return out

    # ---- tokens ------------------------------------------------------------------------------
    def _text_token(self, token_id: int, out: Parsed) -> None:
        if self.mode == "body":
            self.body_ids.append(token_id)
            self._emit_body(out, final=False)
        elif self.mode == "header":
            self.header += self.tokenizer.decode([token_id])
        # text between <|end|> and the next <|start|> is not part of any message: dropped

    def _marker(self, marker: str, out: Parsed) -> None:
        if marker == "<|start|>":
            self.mode, self.header = "header", ""
        elif marker == "<|message|>" and self.mode == "header":
            self._open_message()
        elif marker in ("<|end|>", "<|return|>", "<|call|>") and self.mode == "body":
            self._emit_body(out, final=True)
            self._close_message(out)
        elif self.mode == "header":
            self.header += marker

    def _open_message(self) -> None:
        m = _CHANNEL.search(self.header)
        self.channel = m.group(1) if m else ""
        r = _RECIPIENT.search(self.header)
        self.recipient = r.group(1) if r else None
        self.mode, self.body_ids, self.body_emitted = "body", [], 0
        self.saw_message = True

    # ---- message bodies ----------------------------------------------------------------------
    def _is_tool_call(self) -> bool:
        return self.recipient is not None and self.recipient.startswith("functions.")

    def _emit_body(self, out: Parsed, final: bool) -> None:
        if self._is_tool_call():
            return  # arguments are returned whole with the call
        text = self.tokenizer.decode(self.body_ids)
        if not final:
            text = text.rstrip("\ufffd")  # a multi-byte character still incomplete
        delta, self.body_emitted = text[self.body_emitted:], max(self.body_emitted, len(text))
        if self.channel == "analysis":
            out.reasoning += delta
        elif self.recipient is None:
            out.content += delta

    def _close_message(self, out: Parsed) -> None:
        if self._is_tool_call():
            name = self.recipient.removeprefix("functions.")
            out.tool_calls.append(ToolCall(name, self.tokenizer.decode(self.body_ids).strip()))
        self.mode = "between"
