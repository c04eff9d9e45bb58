"""Where chat messages end, for the hybrid prefix cache: the server's renderer finds the token
offsets of the last messages' ends (ChatPrompt.message_ends -> SamplingParams.message_ends)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from ferryman.errors import InvalidParameterError
from ferryman.kvcache.state_checkpoints import checkpoint_positions
from ferryman.llm import DEMO_MODEL
from ferryman.sampling_params import SamplingParams
from ferryman.server.chat import ChatRenderer

CONVERSATION = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def add(a, b):"},
                {"role": "assistant", "content": "    return a + b"},
                {"role": "user", "content": "Now subtract."}]


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return AutoTokenizer.from_pretrained(DEMO_MODEL, local_files_only=True)


def test_the_renderer_finds_the_last_message_ends(tokenizer) -> None:  # noqa: ANN001
    prompt = ChatRenderer(tokenizer, message_ends=True).render(CONVERSATION)
    heads = [tokenizer.apply_chat_template(CONVERSATION[:k], tokenize=False) for k in (2, 3)]
    assert prompt.message_ends == [len(tokenizer.encode(h, add_special_tokens=False)) for h in heads]
    for end, head in zip(prompt.message_ends, heads):
        assert tokenizer.decode(prompt.token_ids[:end]) == head  # an end is a prefix of the prompt's tokens
    assert ChatRenderer(tokenizer).render(CONVERSATION).message_ends == []  # off unless the engine uses them


def test_checkpoint_positions_are_block_boundaries_below_the_ends() -> None:
    assert checkpoint_positions(100, 16, []) == [96]
    assert checkpoint_positions(100, 16, [40, 70, 99]) == [64, 96]  # the last two ends, floored
    assert checkpoint_positions(100, 16, [10, 200]) == [96]  # inside the first block / past the prompt
    assert checkpoint_positions(10, 16, [5]) == []


def test_message_ends_are_checked() -> None:
    with pytest.raises(InvalidParameterError, match="message_ends"):
        SamplingParams(message_ends=[-1])
