"""Incremental detokenisation and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ferryman.tokenizer import TokenIdText


class IncrementalDetokenizer:
    """Decodes a growing list of token ids; emits only text that can no longer change.

    A trailing U+FFFD means the last token ended inside a multi-byte character: that tail is held
    back until the next token completes it. Stop strings are searched in the text; text from the
    first stop string on is never emitted. Without a tokenizer the text is the ids as `<id>`.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else TokenIdText()
        self.stop = [s for s in stop if s]
        self.text = ""  # stable text emitted so far
        self.stopped = False

    def update(self, token_ids: list[int]) -> str:
        """Feed all output ids so far; returns the new stable text (may be empty)."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")
        for s in self.stop:
            # search only where a new match can start
            idx = full.find(s, max(0, len(self.text) - len(s) + 1))
            if idx != -1:
                full, self.stopped = full[:idx], True
        # hold back a tail that could be the start of a stop string
        hold = 0 if self.stopped else partial_suffix_len(full, self.stop)
        stable = full[: len(full) - hold] if hold else full
        if len(stable) <= len(self.text):
            return ""
        delta = stable[len(self.text) :]
        self.text = stable
        return delta

    def flush(self, token_ids: list[int]) -> str:
        """At the end: everything decoded that a stop string did not cut."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        delta = full[len(self.text) :]
        self.text = full
        return delta


def partial_suffix_len(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (text that
    may yet become a stop string or a tag)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best
