"""A tiny gpt-oss with a harmony-like vocabulary (gpt-oss's special tokens, few of them), written
both ways: as a Hugging Face folder's tokenizer files, the way gpt-oss ships them, and as the GGUF
metadata llama.cpp's converter writes from that folder (tests/test_gguf_converter.py checks the
two byte for byte against the converter itself when the peer kit is at hand).

The vocabulary: GPT-2's 256 byte stand-ins, three merges, then the specials; <|return|> ends the
answer, <|call|> a tool call, <|end|> only a message.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from gguf import GGUFWriter

import tiny_models
from ferryman import LLM

HARMONY_MERGES = ("h e", "l l", "l o")
HARMONY_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|start|>", "<|end|>", "<|message|>",
                    "<|channel|>", "<|call|>")
HARMONY_VOCAB = 256 + len(HARMONY_MERGES) + len(HARMONY_SPECIALS)
HARMONY_TEMPLATE = ("{%- for m in messages -%}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
                    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")
CHAT = [{"role": "user", "content": "hello, tell me all"}, {"role": "assistant", "content": "well"},
        {"role": "user", "content": "hello again"}]


def same_text_handling(gguf: LLM, folder: LLM) -> None:
    """ferryman on the GGUF file and on its folder: the same tokenizer, chat template and end ids
    (<|return|>, <|endoftext|>, <|call|>; not <|end|>)."""
    ends = {harmony_special(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")}
    assert set(gguf.engine.eos_token_ids) == set(folder.engine.eos_token_ids) == ends  # not <|end|>
    for text in ("hello world", "<|start|>user<|message|>hello<|end|>"):
        assert gguf.encode(text) == folder.encode(text), text
    assert gguf.chat_ids(CHAT) == folder.chat_ids(CHAT)
    assert harmony_special("<|end|>") in gguf.chat_ids(CHAT)


def _harmony_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in HARMONY_MERGES] + list(HARMONY_SPECIALS)


def harmony_special(text: str) -> int:
    return 256 + len(HARMONY_MERGES) + HARMONY_SPECIALS.index(text)


def write_harmony_tokenizer(folder: Path) -> None:
    """The harmony-like vocabulary as a Hugging Face folder's tokenizer files (tokenizer.json,
    tokenizer_config.json, chat_template.jinja, generation_config.json's end ids), as gpt-oss ships them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = _harmony_tokens()
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens[:-len(HARMONY_SPECIALS)])},
                     merges=[tuple(m.split()) for m in HARMONY_MERGES])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>", "model_max_length": 512}))
    (folder / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    ends = [harmony_special(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")]
    (folder / "generation_config.json").write_text(json.dumps({
        "bos_token_id": harmony_special("<|startoftext|>"), "eos_token_id": ends,
        "pad_token_id": harmony_special("<|endoftext|>")}))


def harmony_tokenizer(w: GGUFWriter) -> None:
    """The same vocabulary as llama.cpp's converter writes it from write_harmony_tokenizer's folder
    (pre-tokenizer `gpt-4o`, as gen_gguf.py names an unknown o200k-style hash)."""
    tokens = _harmony_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(HARMONY_SPECIALS)) + [3] * len(HARMONY_SPECIALS))
    w.add_token_merges(list(HARMONY_MERGES))
    w.add_bos_token_id(harmony_special("<|startoftext|>"))
    w.add_eos_token_id(harmony_special("<|return|>"))
    w.add_pad_token_id(harmony_special("<|endoftext|>"))
    w.add_chat_template(HARMONY_TEMPLATE)


def build_harmony_gpt_oss(folder: Path) -> torch.nn.Module:
    """tiny_models' gpt-oss (MXFP4 experts) with the harmony vocabulary's size and tokenizer files in
    `folder`; returns the transformers reference model."""
    saved = tiny_models.CONFIGS["gpt_oss"]
    tiny_models.CONFIGS["gpt_oss"] = {**saved, "vocab_size": HARMONY_VOCAB}
    try:
        model = tiny_models.build_tiny("gpt_oss", folder)
    finally:
        tiny_models.CONFIGS["gpt_oss"] = saved
    write_harmony_tokenizer(folder)
    return model
