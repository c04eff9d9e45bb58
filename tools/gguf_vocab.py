"""The tokenizer a random-weight GGUF carries (tools/gguf_random.py), as llama.cpp's converter
writes one for a GPT-2 style byte-level BPE (`tokenizer.ggml.model = "gpt2"`):

- from a model folder's tokenizer.json when it holds a byte-level BPE (the demo model's): its
  tokens, merges, special tokens and chat template;
- else a small byte-level one of the model's vocab size: the 256 byte tokens (GPT-2's byte ->
  character map), merges of common letter pairs, ChatML's special tokens, then filler tokens,
  and a ChatML chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
NORMAL, CONTROL, UNUSED = 1, 3, 5  # gguf.TokenType


@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str] = field(default_factory=list)
    bos: int | None = None
    eos: int | None = None
    chat_template: str | None = None


def byte_chars() -> list[str]:
    """GPT-2's printable character of each byte value 0..255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def synthetic_vocab(vocab_size: int, bos: int | None, eos: int | None) -> Vocab:
    """Byte tokens, letter-pair merges and ChatML specials padded to vocab_size tokens."""
    if vocab_size < 256:
        raise ValueError(f"a byte-level tokenizer needs a vocab of at least 256 tokens, got {vocab_size}")
    tokens, types = byte_chars(), [NORMAL] * 256
    merges: list[str] = []
    letters = "Ġetaoinsrhl"  # Ġ: the space byte's character
    for a in letters:
        for b in letters[1:]:
            if len(tokens) + 3 >= vocab_size:
                break
            merges.append(f"{a} {b}")
            tokens.append(a + b)
            types.append(NORMAL)
    while len(tokens) < vocab_size:
        tokens.append(f"<|filler_{len(tokens)}|>")
        types.append(UNUSED)
    specials = {"<|endoftext|>": bos, "<|im_end|>": eos}
    used = {i for i in specials.values() if i is not None}
    specials["<|im_start|>"] = next(i for i in range(vocab_size - 1, -1, -1) if i not in used)
    for text, i in specials.items():
        if i is not None and 256 + len(merges) <= i < vocab_size:  # never over a byte or merged token
            tokens[i], types[i] = text, CONTROL
    eos_ok = eos is not None and 0 <= eos < vocab_size
    bos_ok = bos is not None and 0 <= bos < vocab_size
    return Vocab(tokens, types, merges, bos if bos_ok else None, eos if eos_ok else None, CHATML)


def folder_vocab(folder: Path, vocab_size: int) -> Vocab | None:
    """A byte-level BPE tokenizer.json in `folder`, as GGUF metadata padded with filler tokens to
    the model's vocab_size; None when there is none."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    tok = json.loads(path.read_text())
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        return None
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    size = max([*vocab.values(), *added.values()]) + 1
    if size > vocab_size:
        raise ValueError(f"{path}: {size} tokens do not fit the model's vocab_size {vocab_size}")
    size = vocab_size
    tokens, types = [f"<|filler_{i}|>" for i in range(size)], [UNUSED] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text, NORMAL
    for text, i in added.items():
        tokens[i], types[i] = text, CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    bos, eos = added.get(cfg.get("bos_token") or ""), added.get(cfg.get("eos_token") or "")
    return Vocab(tokens, types, merges, bos, eos, cfg.get("chat_template") or CHATML)


def write_vocab(writer: Any, vocab: Vocab) -> None:
    """The tokenizer keys of a gguf.GGUFWriter."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    if vocab.bos is not None:
        writer.add_bos_token_id(vocab.bos)
    if vocab.eos is not None:
        writer.add_eos_token_id(vocab.eos)
    writer.add_add_bos_token(False)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
