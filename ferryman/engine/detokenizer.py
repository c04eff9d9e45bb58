"""Incremental detokenisation and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ferryman.tokenizer import TokenIdText


class IncrementalDetokenizer:
    """Decodes a growing list of token ids; emits only text that can no longer change.

    Each step decodes a window of the last few ids, not the whole output (the cost of a step does
    not grow with the output). `committed` is the text of `ids[:read]`; the ids from `prefix` on
    are decoded together so a token's text is taken in the context of the one before it (leading
    spaces of SentencePiece pieces). A trailing U+FFFD means the last token ended inside a
    multi-byte character: the offsets wait, and that tail is held back until a token completes it.
    Stop strings are searched in the text; text from the first stop string on is never emitted.
    Without a tokenizer the text is the ids as `<id>`.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else TokenIdText()
        self.stop = [s for s in stop if s]
        self.text = ""  # stable text emitted so far
        self.stopped = False
        self.committed = ""  # the text of ids[:read]
        self.prefix = 0
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, token_ids: list[int]) -> str:
        """The whole output's text: committed text plus the window's new text (no U+FFFD tail)."""
        before = self._decode(token_ids[self.prefix : self.read])
        window = self._decode(token_ids[self.prefix :])
        if window.endswith("\ufffd") or not window.startswith(before):
            return self.committed + window[len(before) :].rstrip("\ufffd")
        self.committed += window[len(before) :]
        self.prefix, self.read = self.read, len(token_ids)
        return self.committed

    def update(self, token_ids: list[int]) -> str:
        """Feed all output ids so far; returns the new stable text (may be empty)."""
        if self.stopped:
            return ""
        full = self._advance(token_ids)
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
        """At the end: everything decoded that a stop string did not cut (an unfinished character
        included, as U+FFFD)."""
        if self.stopped:
            return ""
        before = self._decode(token_ids[self.prefix : self.read])
        full = self.committed + self._decode(token_ids[self.prefix :])[len(before) :]
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
