"""A GGUF file's byte-level BPE vocabulary built from its metadata by ferryman (tokenizer.py
`byte_level_bpe`, the fallback where transformers cannot convert a file: gpt-oss before 5.24)
against transformers' own conversion of the same file, per pre-tokenizer split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFWriter

from ferryman.tokenizer import BPE_SPLITS, byte_level_bpe, load_gguf_tokenizer

SPECIALS = ("<|endoftext|>", "<|return|>", "<|start|>", "<|end|>", "<|message|>")
# merges that cross the splits' boundaries differently: digit runs (1-3 digits against one), a
# space before a word, an apostrophe suffix, a newline pair, capitals after lower case
MERGES = ("1 2", "12 3", "Ġ w", "h e", "l l", "he ll", "hell o", "' s", "Ċ Ċ", "a B", "Ġ Ġ")
TEXTS = ("hello world", "it's 12345 and 7", "helloWorld HELLO's xaBy", "a\n\n\nb  c\t\td   ",
         "ünïcödé 你好 🙂 x", "<|start|>user<|message|>hello<|end|>", "path/to/file.py\r\n12 3", "")
TEMPLATE = "{% for m in messages %}<|start|>{{ m['content'] }}<|end|>{% endfor %}"


def _meta(pre: str) -> dict[str, Any]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), *(m.replace(" ", "") for m in MERGES), *SPECIALS, "<think>"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * (len(tokens) - len(SPECIALS) - 1) + [3] * len(SPECIALS) + [4],
            "tokenizer.ggml.merges": list(MERGES), "tokenizer.ggml.bos_token_id": tokens.index("<|start|>"),
            "tokenizer.ggml.eos_token_id": tokens.index("<|end|>"), "tokenizer.chat_template": TEMPLATE}


def _write(meta: dict[str, Any], path: Path) -> Path:
    """A GGUF file holding the tokenizer metadata only (llama.cpp's keys, qwen3moe architecture)."""
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(meta["tokenizer.chat_template"])
    for key in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{key}" in meta:
            getattr(w, f"add_{key}")(meta[f"tokenizer.ggml.{key}"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("pre", sorted(BPE_SPLITS))
@pytest.mark.parametrize("bos,eos", [(None, None), (False, False), (True, False), (True, True)])
def test_byte_level_bpe_equals_transformers(pre: str, bos: bool | None, eos: bool | None, tmp_path: Path) -> None:
    """Ids with and without the special tokens around them (the file's add_bos_token / add_eos_token,
    absent or set), decoding, special tokens, chat template, added tokens."""
    from transformers import PreTrainedTokenizerFast

    meta = _meta(pre)
    if bos is not None:
        meta |= {"tokenizer.ggml.add_bos_token": bos, "tokenizer.ggml.add_eos_token": eos}
    path = _write(meta, tmp_path / "t.gguf")
    import transformers

    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.24"):  # the reference conversion
        pytest.skip(f"transformers {transformers.__version__} converts GGUF vocabularies without their control "
                    "tokens and pre-tokenizer splits; the reference is 5.24's")
    want = PreTrainedTokenizerFast.from_pretrained(str(tmp_path), gguf_file=path.name, local_files_only=True)
    got = byte_level_bpe(meta.get)
    assert got is not None
    around = got.encode("x")
    assert (around[0] == meta["tokenizer.ggml.bos_token_id"]) == bool(bos)
    assert (around[-1] == meta["tokenizer.ggml.eos_token_id"]) == bool(eos)
    for text in TEXTS:
        assert got.encode(text) == want.encode(text), (pre, text)
        ids = got.encode(text, add_special_tokens=False)
        assert ids == want.encode(text, add_special_tokens=False), (pre, text)
        assert got.decode(ids) == want.decode(ids) == text
    assert got.bos_token == want.bos_token == "<|start|>" and got.eos_token == want.eos_token == "<|end|>"
    assert got.chat_template == TEMPLATE
    assert got.all_special_tokens == want.all_special_tokens
    ids = got.encode("<|start|>hi<|message|>x<think><|endoftext|>", add_special_tokens=False)
    assert got.decode(ids, skip_special_tokens=True) == want.decode(ids, skip_special_tokens=True) == "hix<think>"
    assert got.encode("<think>", add_special_tokens=False) == [len(meta["tokenizer.ggml.tokens"]) - 1]


def test_the_splits_differ_where_the_merges_say() -> None:
    """The test above can tell the splits apart: these texts encode differently under each."""
    def encode(pre: str) -> tuple[tuple[int, ...], ...]:
        tok = byte_level_bpe(_meta(pre).get)
        assert tok is not None
        return tuple(tuple(tok.encode(t, add_special_tokens=False)) for t in TEXTS)

    assert encode("gpt-4o") != encode("qwen2")


def test_other_vocabularies_are_left_to_transformers() -> None:
    assert byte_level_bpe({**_meta("gpt-4o"), "tokenizer.ggml.pre": "default"}.get) is None
    assert byte_level_bpe({**_meta("gpt-4o"), "tokenizer.ggml.model": "llama"}.get) is None


def test_known_vocabularies_do_not_ask_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte-level BPE file of a known split is built from its metadata (transformers before 5.24
    fails on gpt-oss files); another still goes to transformers, and its failure is a clear error."""
    import transformers

    meta = _meta("gpt-4o")
    path = _write(meta, tmp_path / "t.gguf")
    asked: list[str] = []

    def refuse(*args: object, **kwargs: object) -> None:
        asked.append(str(kwargs.get("gguf_file")))
        raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "from_pretrained", refuse)
    tok, own = load_gguf_tokenizer(path, meta.get), byte_level_bpe(meta.get)
    assert own is not None and not asked
    assert tok.encode("hello xaBy", add_special_tokens=False) == own.encode("hello xaBy", add_special_tokens=False)
    from ferryman.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="config-folder"):
        load_gguf_tokenizer(path, {**meta, "tokenizer.ggml.pre": "default"}.get)
    assert asked == ["t.gguf", "t.gguf"]


def test_a_special_id_outside_the_vocabulary_is_a_clear_error(tmp_path: Path) -> None:
    from ferryman.errors import ModelLoadError

    meta = {**_meta("qwen2"), "tokenizer.ggml.eos_token_id": 10_000}
    with pytest.raises(ModelLoadError, match=r"t.gguf from its metadata: ValueError: eos_token_id 10000 is outside "
                                             r"the vocabulary of \d+ tokens"):
        load_gguf_tokenizer(tmp_path / "t.gguf", meta.get)
