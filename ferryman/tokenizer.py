"""Tokenizers and chat templates through transformers, from local files only."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferryman.errors import ModelLoadError

# Never reach a model hub: every file must already be in the model folder.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(folder: Path | None) -> Any | None:
    """The folder's tokenizer, or None when it ships none (tiny test models, presets)."""
    if folder is None or not any((folder / f).exists() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers and tokenizers raise many kinds for a bad file
        raise ModelLoadError(f"cannot load the tokenizer of {folder}: {type(e).__name__}: {e}") from None


Meta = Callable[[str], Any]  # a GGUF metadata key -> its value (None when absent)


def load_gguf_tokenizer(path: Path, meta: Meta) -> Any:
    """The tokenizer (and chat template) a GGUF file's metadata describes (the caller has seen its
    `tokenizer.ggml.model`). A byte-level BPE vocabulary of a known split (gpt-oss, Qwen3 files) is
    built from the metadata already read (`byte_level_bpe`, checked against transformers'
    conversion: transformers before 5.24 cannot convert gpt-oss files and cuts the control tokens
    of others into pieces); any other is converted offline by transformers."""
    try:
        own = byte_level_bpe(meta)
    except Exception as e:  # tokenizers raises its own kinds for bad merges or tokens
        raise ModelLoadError(f"cannot build the tokenizer of {path} from its metadata: {type(e).__name__}: {e}; "
                             f"pass config_folder (--config-folder) with the model's tokenizer files") from None
    if own is not None:
        return own
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    last: Exception | None = None
    # AutoTokenizer picks the class from the file's architecture; one transformers does not know
    # (olmoe, mixtral-as-llama with experts) still converts through the generic fast tokenizer
    for cls in (AutoTokenizer, PreTrainedTokenizerFast):
        try:
            return cls.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except Exception as e:  # transformers raises many kinds for a file it cannot convert
            last = e
    raise ModelLoadError(f"cannot build the tokenizer of {path} from its metadata: {type(last).__name__}: {last}; "
                         f"pass config_folder (--config-folder) with the model's tokenizer files") from None


# llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`) -> the split its vocabulary's merges were
# learned on (llama.cpp's llama-vocab.cpp; tiktoken's o200k for gpt-4o)
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_O200K_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"  # o200k splits a word at its case: upper, then lower
_O200K_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_O200K_UPPER}*{_O200K_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_O200K_UPPER}+{_O200K_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BPE_SPLITS = {"gpt-4o": _GPT4O_SPLIT, "qwen2": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def byte_level_bpe(meta: Meta) -> Any | None:
    """A byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2", a `tokenizer.ggml.pre` of
    BPE_SPLITS) from the file's vocabulary, merges and token types, as transformers converts one:
    control tokens special, user-defined ones plain added tokens, the chat template and special
    tokens from the metadata, a BOS / EOS around each encoding where `add_bos_token` /
    `add_eos_token` say so. None for any other vocabulary."""
    split = BPE_SPLITS.get(meta("tokenizer.ggml.pre"))
    if meta("tokenizer.ggml.model") != "gpt2" or split is None or None in (meta("tokenizer.ggml.merges"),
                                                                             meta("tokenizer.ggml.tokens")):
        return None
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()  # byte -> the printable character a byte-level vocabulary spells it with
    alphabet = set(spelling.values())
    tokens = [str(t) for t in meta("tokenizer.ggml.tokens")]
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    merges = [tuple(m.split(" ")) for m in meta("tokenizer.ggml.merges")]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges, dropout=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    types = list(meta("tokenizer.ggml.token_type") or ())
    # a control token outside the byte alphabet is a converter's mislabel: adding it would grow the vocabulary
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
                            if k == _CONTROL and set(t) <= alphabet])
    known = set(spelled)  # a user-defined token outside the vocabulary would grow it: skipped
    bpe.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED and t in known])
    ids = {name: meta(f"tokenizer.ggml.{key}") for name, key in (("bos_token", "bos_token_id"),
           ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    for name, i in ids.items():
        if i is not None and not 0 <= int(i) < len(tokens):
            raise ValueError(f"{name}_id {i} is outside the vocabulary of {len(tokens)} tokens")
    named = {name: tokens[int(i)] for name, i in ids.items() if i is not None}
    add = {"bos_token": bool(meta("tokenizer.ggml.add_bos_token")) and "bos_token" in named,
           "eos_token": bool(meta("tokenizer.ggml.add_eos_token")) and "eos_token" in named}
    if any(add.values()):
        bpe.post_processor = _around(named, ids, add)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=meta("tokenizer.chat_template"),
                                   add_bos_token=add["bos_token"], add_eos_token=add["eos_token"], **named)


def _around(named: dict[str, str], ids: dict[str, Any], add: dict[str, bool]) -> Any:
    """The post-processor that puts the BOS before and the EOS after an encoding, as transformers'
    TokenizersBackend.update_post_processor builds it."""
    from tokenizers import processors

    bos = [named["bos_token"]] if add["bos_token"] else []
    eos = [named["eos_token"]] if add["eos_token"] else []
    single = " ".join([*(f"{t}:0" for t in bos), "$A:0", *(f"{t}:0" for t in eos)])
    pair = " ".join([single, *(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)])
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=[(named[t], int(ids[t])) for t in add if add[t]])


class TokenIdText:
    """The text of a model without tokenizer files (dummy presets, bare checkpoints): every token
    shown as `<id>`, so outputs stay visible and streamable (`ferryman bench serve` counts them)."""

    eos_token_id = None
    chat_template = None

    @staticmethod
    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{int(i)}>" for i in ids)


def extra_eos_ids(folder: Path | None, tokenizer: Any | None) -> set[int]:
    """End-of-sequence ids beyond config.json: generation_config.json and the tokenizer's eos."""
    ids: set[int] = set()
    if folder is not None and (folder / "generation_config.json").exists():
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model ships no tokenizer, so it has no chat template")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)
