"""Byte-level BPE tokenizer (the `tokenizers` library) and the token streams it makes.

Saved as tokenizer.json + tokenizer_config.json so that
`transformers.AutoTokenizer.from_pretrained(folder)` gives a PreTrainedTokenizerFast offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tools.demo_model.config import EOS_TOKEN, SPECIAL_TOKENS

# ChatML, as Qwen models use it. The model is a code completer: this only gives ferryman's
# chat endpoint a well-formed prompt to send.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: no normaliser, no prefix space, so decode(encode(s)) == s for any string."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),  # ids 0, 1, 2 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def token_id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ValueError(f"token {token!r} is not in the tokenizer's vocabulary")
    return found


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int) -> dict:
    """tokenizer_config.json contents, chat template included."""
    added = {
        str(token_id(tokenizer, tok)): {
            "content": tok, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tokenizer: Tokenizer, out: Path, model_max_length: int) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    config = tokenizer_config(tokenizer, model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def encode_stream(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """All texts as one token stream, each followed by <|endoftext|>: [N] uint16."""
    eos = token_id(tokenizer, EOS_TOKEN)
    if tokenizer.get_vocab_size() > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"vocab of {tokenizer.get_vocab_size()} does not fit uint16 token streams")
    pieces = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        pieces.append(np.asarray(encoding.ids, dtype=np.uint16))
        pieces.append(np.asarray([eos], dtype=np.uint16))
    return np.concatenate(pieces)


def pack_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Cut the stream into consecutive full windows (the tail shorter than seq_len is dropped).

    Returns [W, seq_len] int64; window w holds stream[w*seq_len : (w+1)*seq_len].
    """
    count = len(stream) // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    if count == 0:
        raise ValueError(f"a stream of {len(stream)} tokens holds no window of {seq_len} tokens")
    windows = stream[: count * seq_len].reshape(count, seq_len)
    return torch.from_numpy(windows.astype(np.int64))
