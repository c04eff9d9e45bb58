"""The incremental detokenizer against the tokenizer's own decode of the whole output."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from ferryman.engine.detokenizer import IncrementalDetokenizer
from ferryman.tokenizer import load_tokenizer

DEMO = Path(__file__).resolve().parents[1] / "ferryman" / "assets" / "demo-moe"


class Recording:
    """A tokenizer that records how many ids each decode call was given."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.lengths = tok, []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(DEMO)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    out = "".join(detok.update(ids[:i]) for i in range(1, len(ids) + 1))
    return out + detok.flush(ids)


@pytest.mark.parametrize("seed", range(20))
def test_streamed_text_equals_whole_decode(tok: Any, seed: int) -> None:
    rng = random.Random(seed)
    text = "héllo wörld 日本語 テキスト 🚀🚀 ok\n\tdef f(x): return x"
    ids = tok.encode(text, add_special_tokens=False) if seed % 2 else [rng.randrange(tok.vocab_size) for _ in range(80)]
    assert stream(IncrementalDetokenizer(tok, []), ids) == tok.decode(ids, skip_special_tokens=True)


def test_multibyte_character_is_held_until_complete(tok: Any) -> None:
    ids = tok.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level pieces of one character
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.update(ids[:i]) for i in range(1, len(ids))] == [""] * (len(ids) - 1)
    assert detok.update(ids) == "🚀"


def test_each_step_decodes_a_window_not_the_whole_output(tok: Any) -> None:
    ids = tok.encode("the quick brown fox jumps over the lazy dog " * 40, add_special_tokens=False)
    rec = Recording(tok)
    out = stream(IncrementalDetokenizer(rec, []), ids)
    assert out == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) > 300 and max(rec.lengths) <= 4


def test_stop_string_cuts_and_holds_back_a_partial_match(tok: Any) -> None:
    ids = tok.encode("alpha beta STOP gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, ["STOP"])
    out = "".join(detok.update(ids[:i]) for i in range(1, len(ids) + 1))
    assert detok.stopped and out == "alpha beta " and detok.flush(ids) == ""
