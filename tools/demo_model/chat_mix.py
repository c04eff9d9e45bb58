"""The chat fine-tune's conversations: code requests, short answers and tool use, after no system
message, a short one, or a long agent-like one (4k-16k tokens), in one or several turns.

Every conversation ends with an assistant message; each assistant message is trained on with its
`<|im_end|>` (chat_data.encode_conversation). All choices come from one seeded random.Random.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tokenizers import Tokenizer

from tools.demo_model.chat_agent import Material, agent_system, material, short_exchange, tool_turns
from tools.demo_model.chat_data import ChatSample, Exchange, assistant_spans, encode_split, exchanges, system_texts

Messages = list[tuple[str, str]]
MATERIAL_FILES = 240  # files whose docstrings, functions and text make the agent-like content
CONTEXT_SHARE = 0.3  # long conversations whose task follows a user message of environment context


@dataclass(frozen=True, slots=True)
class MixSpec:
    """What the conversations are made of (shares are probabilities per conversation)."""

    short_len: int = 1024  # longest conversation without a long system message, in tokens
    long_min: int = 4096  # a long system message's size in tokens, drawn uniformly in [long_min, long_max]
    long_max: int = 16384
    system_share: float = 0.3  # short conversations after a short system message (a module docstring)
    earlier_share: float = 0.35  # conversations with 1-2 earlier exchanges before the last one
    short_answer_share: float = 0.3  # last exchanges with a short prose answer
    tool_share: float = 0.15  # last exchanges that call a tool, read its result, then answer

    def __post_init__(self) -> None:
        if self.short_len < 16 or not 0 < self.long_min <= self.long_max:
            raise ValueError(f"bad chat mix lengths: {self}")
        if self.short_answer_share + self.tool_share > 1:
            raise ValueError(f"short_answer_share + tool_share must be <= 1: {self}")


@dataclass(slots=True)
class Sources:
    """The corpus material conversations draw from."""

    exchanges: list[Exchange]
    systems: list[str]
    material: Material
    next_exchange: int = 0

    def exchange(self) -> Exchange:
        ex = self.exchanges[self.next_exchange % len(self.exchanges)]
        self.next_exchange += 1
        return ex


def sources(texts: list[str], names: list[str], seed: int, max_chars: int, count: int) -> Sources:
    found = exchanges(texts, seed, max_chars, limit=count, per_file=16)
    if not found:
        raise ValueError(f"the {len(texts)} corpus files gave no chat exchange")
    picked = random.Random(seed).sample(range(len(texts)), min(len(texts), MATERIAL_FILES))
    return Sources(found, system_texts(texts[:200]), material([texts[i] for i in picked], [names[i] for i in picked]))


def last_turns(rng: random.Random, src: Sources, mix: MixSpec) -> Messages:
    roll = rng.random()
    if roll < mix.tool_share and src.material.files:
        return tool_turns(rng, src.material)
    if roll < mix.tool_share + mix.short_answer_share:
        ask, answer = short_exchange(rng, src.material)
        return [("user", ask), ("assistant", answer)]
    ex = src.exchange()
    return [("user", ex.request), ("assistant", ex.answer)]


def earlier_turns(rng: random.Random, src: Sources, mix: MixSpec) -> Messages:
    out: Messages = []
    for _ in range(rng.randint(1, 2) if rng.random() < mix.earlier_share else 0):
        out += last_turns(rng, src, mix)
    return out


def conversation(rng: random.Random, src: Sources, mix: MixSpec, long: bool, count_tokens) -> Messages:
    """One conversation; `long`: it opens with an agent-like system message of long_min..long_max tokens."""
    if long:
        size = rng.randint(mix.long_min, mix.long_max)
        head: Messages = [("system", agent_system(rng, src.material, size, count_tokens))]
        if rng.random() < CONTEXT_SHARE:
            head.append(("user", f"<environment_context>\n  <cwd>/home/user/project</cwd>\n  <shell>bash</shell>\n"
                                 f"</environment_context>"))
    elif src.systems and rng.random() < mix.system_share:
        head = [("system", rng.choice(src.systems))]
    else:
        head = []
    return head + earlier_turns(rng, src, mix) + last_turns(rng, src, mix)


def chars_per_token(tokenizer: Tokenizer, texts: list[str]) -> float:
    sample = "\n".join(texts[:20])[:200_000]
    return len(sample) / max(1, len(tokenizer.encode(sample, add_special_tokens=False).ids))


def encode_all(tokenizer: Tokenizer, convs: list[Messages], end_id: int) -> list[ChatSample]:
    """Tokenise every conversation (in parallel) and label its assistant messages."""
    rendered = [assistant_spans(c) for c in convs]
    return encode_split(tokenizer, [text for text, _ in rendered], [spans for _, spans in rendered], end_id)


def mixed_samples(tokenizer: Tokenizer, texts: list[str], names: list[str], mix: MixSpec, seed: int,
                  end_id: int, short: int, long: int) -> tuple[list[ChatSample], list[ChatSample]]:
    """`short` conversations of at most short_len tokens and `long` ones after a long system
    message (at most long_max + short_len tokens), seeded; too long ones are dropped."""
    rng = random.Random(seed)
    ratio = chars_per_token(tokenizer, texts)
    src = sources(texts, names, seed, max_chars=int(ratio * mix.short_len / 2), count=short + long)
    count_tokens = lambda text: int(len(text) / ratio)  # noqa: E731 (estimate; the final encoding is exact)
    short_convs = [conversation(rng, src, mix, False, count_tokens) for _ in range(short)]
    long_convs = [conversation(rng, src, mix, True, count_tokens) for _ in range(long)]
    shorts = [s for s in encode_all(tokenizer, short_convs, end_id) if len(s.ids) <= mix.short_len]
    longs = [s for s in encode_all(tokenizer, long_convs, end_id) if len(s.ids) <= mix.long_max + mix.short_len]
    return shorts, longs
