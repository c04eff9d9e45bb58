"""Chat-formatted samples built from the corpus, so the demo model learns to end its turns.

Each sample is a ChatML conversation rendered exactly as the model's chat template renders it
(`<|im_start|>role\\ncontent<|im_end|>\\n` per message): a user turn with a short request (a
function's docstring, its signature, or a file's first lines), optionally after a system message
(a module docstring: prose the answer should not depend on), and an assistant turn with the code
followed by `<|im_end|>`. Only the assistant's code and its `<|im_end|>` are trained on.
"""

from __future__ import annotations

import ast
import random
import textwrap
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

IGNORE = -100  # label of a token that is not trained on (F.cross_entropy's ignore_index)
SYSTEM_SHARE = 0.3  # share of samples that open with a system message
MAX_SYSTEM_CHARS = 600
HEAD_LINES = (3, 12)  # a file-head request shows this many first lines (inclusive range)
PER_FILE = 4  # functions taken from one file at most, so many files take part


@dataclass(frozen=True, slots=True)
class Exchange:
    """One request and its answer (the answer is code, without the end-of-turn token)."""

    request: str
    answer: str


@dataclass(frozen=True, slots=True)
class ChatSample:
    ids: list[int]  # the rendered conversation, tokenised
    labels: list[int]  # ids where trained on, IGNORE elsewhere
    prompt_len: int  # tokens up to and including the last `<|im_start|>assistant\n`


def render(messages: list[tuple[str, str]], add_generation_prompt: bool) -> str:
    """The model's ChatML template (tokenizer_config.json's chat_template), as plain Python."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> str:
    """`def name(args) -> ret:` as written, on one line (node.lineno is the `def` line)."""
    header = []
    for line in lines[node.lineno - 1:node.body[0].lineno - 1] or [lines[node.lineno - 1]]:
        header.append(line.strip())
        if line.rstrip().endswith(":"):
            break
    return " ".join(header)


def _function_requests(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> list[str]:
    sig = _signature(node, lines)
    doc = (ast.get_docstring(node) or "").strip()
    requests = [f"Write a Python function `{sig}`", sig]
    if doc:
        first = doc.split("\n\n", 1)[0].strip()
        requests += [first, f"Write `{node.name}` in Python: {first}"]
    return requests


def parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def function_exchanges(text: str, tree: ast.Module, rng: random.Random, max_chars: int) -> list[Exchange]:
    """A request and its code for each function (top level or method) of a source file."""
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        code = "\n".join(lines[first - 1:node.end_lineno])  # whole lines: get_source_segment re-splits the file
        if len(code) > max_chars:
            continue
        out.append(Exchange(rng.choice(_function_requests(node, lines)), textwrap.dedent(code).rstrip()))
    return out


def head_exchange(text: str, tree: ast.Module, rng: random.Random, max_chars: int) -> Exchange | None:
    """A file's first lines as the request; the answer runs from there to the end of the next
    top-level statement (a natural place to stop), if that fits in max_chars."""
    lines = text.splitlines()
    k = rng.randint(*HEAD_LINES)
    if len(lines) < k + 2:
        return None
    ends = sorted(node.end_lineno for node in tree.body if node.end_lineno)
    end = next((e for e in ends if e > k), None)
    if end is None:
        return None
    answer_text = "\n".join(lines[k:end]).rstrip()
    if not answer_text.strip() or len(answer_text) > max_chars:
        return None
    return Exchange("\n".join(lines[:k]), answer_text)


def system_texts(texts: list[str]) -> list[str]:
    """Module docstrings, cut to MAX_SYSTEM_CHARS: prose to stand in for a system prompt."""
    out = []
    for text in texts:
        try:
            doc = ast.get_docstring(ast.parse(text))
        except (SyntaxError, ValueError):
            doc = None
        if doc and len(doc) > 40:
            out.append(doc[:MAX_SYSTEM_CHARS].strip())
    return out


def exchanges(texts: list[str], seed: int, max_chars: int, limit: int, per_file: int = PER_FILE) -> list[Exchange]:
    """About `limit` exchanges: files in a seeded order, up to per_file functions and the head of each."""
    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    out: list[Exchange] = []
    for i in order:
        tree = parse(texts[i])
        if tree is None:
            continue
        found = function_exchanges(texts[i], tree, rng, max_chars)
        out += rng.sample(found, min(per_file, len(found)))
        head = head_exchange(texts[i], tree, rng, max_chars)
        if head is not None:
            out.append(head)
        if len(out) >= limit:
            break
    rng.shuffle(out)
    return out


def conversation(ex: Exchange, systems: list[str], rng: random.Random) -> list[tuple[str, str]]:
    messages = [("system", rng.choice(systems))] if systems and rng.random() < SYSTEM_SHARE else []
    return messages + [("user", ex.request)]


def encode_sample(tokenizer: Tokenizer, messages: list[tuple[str, str]], answer: str, end_id: int) -> ChatSample:
    """Tokenise the whole rendered conversation at once (as a server would) and label only the
    answer's tokens and the `<|im_end|>` that closes it."""
    return encode_conversation(tokenizer, messages + [("assistant", answer)], end_id, train_all=False)


def assistant_spans(messages: list[tuple[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) characters of each assistant message's content."""
    text, spans = "", []
    for role, content in messages:
        text += f"<|im_start|>{role}\n"
        if role == "assistant":
            spans.append((len(text), len(text) + len(content)))
        text += f"{content}<|im_end|>\n"
    return text, spans


def label_encoding(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]],
                   end_id: int) -> ChatSample:
    """Labels on the tokens that start inside `spans` and on the `<|im_end|>` right after each;
    prompt_len: the tokens that start before the last span (the prompt with its generation prompt)."""
    tokens = np.asarray(ids, dtype=np.int64)  # [T]
    starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]  # [T] first character of each token
    trained = np.zeros(len(tokens), dtype=bool)
    for start, end in spans:
        trained |= ((starts >= start) & (starts < end)) | ((starts == end) & (tokens == end_id))
    labels = np.where(trained, tokens, IGNORE)
    return ChatSample(list(ids), labels.tolist(), int((starts < spans[-1][0]).sum()))


def encode_split(tokenizer: Tokenizer, texts: list[str], spans: list[list[tuple[int, int]]],
                 end_id: int) -> list[ChatSample]:
    """Tokenise each rendered conversation in two parts, split where its last assistant message
    starts: a server tokenises the prompt alone (ending with `assistant\\n`) and the model writes
    on from there, so no token may straddle that point (BPE would merge `\\n` with an answer's
    leading spaces otherwise)."""
    cuts = [sp[-1][0] for sp in spans]
    heads = tokenizer.encode_batch([t[:c] for t, c in zip(texts, cuts)], add_special_tokens=False)
    tails = tokenizer.encode_batch([t[c:] for t, c in zip(texts, cuts)], add_special_tokens=False)
    out = []
    for head, tail, sp, cut in zip(heads, tails, spans, cuts):
        offsets = head.offsets + [(lo + cut, hi + cut) for lo, hi in tail.offsets]
        out.append(label_encoding(head.ids + tail.ids, offsets, sp, end_id))
    return out


def encode_conversation(tokenizer: Tokenizer, messages: list[tuple[str, str]], end_id: int,
                        train_all: bool = True) -> ChatSample:
    """A conversation ending with an assistant message, tokenised as encode_split does; every
    assistant message (train_all) or only the last one is labelled, each with its `<|im_end|>`."""
    text, spans = assistant_spans(messages)
    return encode_split(tokenizer, [text], [spans if train_all else spans[-1:]], end_id)[0]


def chat_samples(tokenizer: Tokenizer, texts: list[str], seed: int, max_len: int, end_id: int,
                 count: int) -> list[ChatSample]:
    """Up to `count` seeded chat samples of at most max_len tokens whose answer ends with `<|im_end|>`."""
    rng = random.Random(seed + 1)
    systems = system_texts(texts[:200])
    out = []
    for ex in exchanges(texts, seed, max_chars=4 * max_len, limit=2 * count):
        sample = encode_sample(tokenizer, conversation(ex, systems, rng), ex.answer, end_id)
        if len(sample.ids) <= max_len and end_id in sample.labels:
            out.append(sample)
            if len(out) >= count:
                break
    return out


def collate(samples: list[ChatSample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] ids and labels (padding is IGNORE; causal attention never sees it)."""
    width = max(len(s.ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.int64)
    labels = torch.full((len(samples), width), IGNORE, dtype=torch.int64)
    for row, s in enumerate(samples):
        ids[row, :len(s.ids)] = torch.tensor(s.ids)
        labels[row, :len(s.labels)] = torch.tensor(s.labels)
    return ids, labels
