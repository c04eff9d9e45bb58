"""Prefix caching on a hybrid model (gated DeltaNet + attention): an agent's next turn restores the
state checkpoint saved at the end of the last prompt's last full block and prefills only the tail;
its tokens equal a cold prefill's and transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferryman import LLM, SamplingParams
from tiny_models import build_tiny, hf_greedy

S = 16  # block size
TURN1 = [(i * 37) % 250 + 3 for i in range(45)]  # checkpoint at 32 (the block boundary below token 45)
NEW = [(i * 11) % 250 + 3 for i in range(20)]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("qwen3_next_prefix")
    return folder, build_tiny("qwen3_next", folder)


def _fed_tokens(llm: LLM) -> list[int]:
    """Wrap the runner: per step, the tokens it computed (the list fills as steps run)."""
    runner, fed = llm.engine.runner, []
    inner = runner.execute

    def counted(out):  # noqa: ANN001, ANN202
        fed.append(out.num_batched_tokens)
        return inner(out)

    runner.execute = counted  # type: ignore[method-assign]
    return fed


def _llm(folder: Path, **kw: object) -> LLM:
    return LLM(str(folder), device="cpu", dtype="float32", enforce_eager=True, block_size=S, **kw)


def _greedy(llm: LLM, prompt: list[int], n: int, message_ends: tuple[int, ...] = ()):  # noqa: ANN202
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, message_ends=list(message_ends))
    return llm.generate(prompt_token_ids=[prompt], params=params)[0]


def _assert_restored(out, fed: list[int], prompt: list[int], hybrid: tuple[Path, torch.nn.Module]) -> None:  # noqa: ANN001
    """`out` restored the checkpoint at 32 and prefilled only the tail after it (its other steps
    decode), and its tokens equal a cold engine's and transformers'."""
    folder, ref = hybrid
    n = len(out.token_ids)
    assert out.metrics.num_cached_tokens == 32
    assert sum(fed) == (len(prompt) - 32) + n - 1, "only the tail after the checkpoint is prefilled"
    cold = _greedy(_llm(folder, enable_prefix_caching=False), prompt, n)
    assert out.token_ids == cold.token_ids == hf_greedy(ref, prompt, n)


def test_second_turn_restores_the_checkpoint(hybrid: tuple[Path, torch.nn.Module]) -> None:
    llm = _llm(hybrid[0])
    fed = _fed_tokens(llm)
    first = _greedy(llm, TURN1, 8)
    assert fed[:2] == [45, 1], "one prefill step runs past the checkpoint position (and saves there)"
    turn2 = TURN1 + first.token_ids + NEW
    fed.clear()
    # blocks 0..2 hold KV, but only the prefix of blocks 0..1 has its state checkpointed
    _assert_restored(_greedy(llm, turn2, 6), fed, turn2, hybrid)


def test_kv_hit_without_a_checkpoint_is_not_taken(hybrid: tuple[Path, torch.nn.Module]) -> None:
    """A prompt sharing cached blocks but none of its checkpoints recomputes from position 0."""
    folder, ref = hybrid
    llm = _llm(folder)
    _greedy(llm, TURN1[:20], 2)  # caches block 0's KV; its checkpoint is at 16
    llm.engine.scheduler.reset_prefix_cache()  # drops KV hashes and checkpoints
    _greedy(llm, TURN1[:40], 2)  # checkpoint at 32; blocks 0, 1 cached
    fed = _fed_tokens(llm)
    out = _greedy(llm, TURN1[:24], 4)  # shares block 0 (cached KV, no checkpoint at 16)
    assert out.metrics.num_cached_tokens == 0 and sum(fed) == 24 + 3
    assert out.token_ids == hf_greedy(ref, TURN1[:24], 4)


SYSTEM = [(i * 29) % 250 + 3 for i in range(40)]  # a shared first message: ends at 40, checkpoint at 32
USER_A = [(i * 13) % 250 + 3 for i in range(30)]
USER_B = [(i * 17) % 250 + 5 for i in range(27)]


def test_branch_restores_a_message_end_checkpoint(hybrid: tuple[Path, torch.nn.Module]) -> None:
    """A conversation that branches after its first message (same system prompt, another user
    message) restores the checkpoint saved at that message's end and prefills only the rest."""
    llm = _llm(hybrid[0])
    fed = _fed_tokens(llm)
    first = SYSTEM + USER_A
    _greedy(llm, first, 4, message_ends=(len(SYSTEM), len(first)))
    assert fed[:2] == [70, 1], "one prefill step saves at the message end's and the prompt's checkpoints"
    branch = SYSTEM + USER_B
    fed.clear()
    _assert_restored(_greedy(llm, branch, 6, message_ends=(len(SYSTEM), len(branch))), fed, branch, hybrid)


def test_without_message_ends_a_branch_prefills_everything(hybrid: tuple[Path, torch.nn.Module]) -> None:
    """The control: with only the prompt-end checkpoint, the branch shares no checkpointed prefix."""
    folder, _ = hybrid
    llm = _llm(folder)
    _greedy(llm, SYSTEM + USER_A, 4)
    second = _greedy(llm, SYSTEM + USER_B, 6)
    assert second.metrics.num_cached_tokens == 0
