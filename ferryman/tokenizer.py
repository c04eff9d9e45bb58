"""Tokenizers and chat templates through transformers, from local files only."""

from __future__ import annotations

import json
import os
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


def load_gguf_tokenizer(path: Path) -> Any:
    """The tokenizer (and chat template) a GGUF file's metadata describes (the caller has seen its
    `tokenizer.ggml.model`), converted offline by transformers."""
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
