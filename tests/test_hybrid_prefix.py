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


def _greedy(llm: LLM, prompt: list[int], n: int):  # noqa: ANN202
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return llm.generate(prompt_token_ids=[prompt], params=params)[0]


def test_second_turn_restores_the_checkpoint(hybrid: tuple[Path, torch.nn.Module]) -> None:
    folder, ref = hybrid
    llm = LLM(str(folder), device="cpu", dtype="float32", enforce_eager=True, block_size=S)
    fed = _fed_tokens(llm)
    first = _greedy(llm, TURN1, 8)
    assert fed[:2] == [32, 13], "the prefill chunk stops at the checkpoint position"
    turn2 = TURN1 + first.token_ids + NEW
    fed.clear()
    second = _greedy(llm, turn2, 6)
    # blocks 0..2 hold KV, but only the prefix of blocks 0..1 has its state checkpointed
    assert second.metrics.num_cached_tokens == 32
    assert sum(fed) == (len(turn2) - 32) + 5, "only the tail after the checkpoint is prefilled"
    cold = _greedy(LLM(str(folder), device="cpu", dtype="float32", enforce_eager=True, block_size=S,
                       enable_prefix_caching=False), turn2, 6)
    assert second.token_ids == cold.token_ids == hf_greedy(ref, turn2, 6)


def test_kv_hit_without_a_checkpoint_is_not_taken(hybrid: tuple[Path, torch.nn.Module]) -> None:
    """A prompt sharing cached blocks but none of its checkpoints recomputes from position 0."""
    folder, ref = hybrid
    llm = LLM(str(folder), device="cpu", dtype="float32", enforce_eager=True, block_size=S)
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
    folder, ref = hybrid
    llm = LLM(str(folder), device="cpu", dtype="float32", enforce_eager=True, block_size=S)
    fed = _fed_tokens(llm)
    first = SYSTEM + USER_A
    llm.generate(prompt_token_ids=[first], params=SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, message_ends=[len(SYSTEM), len(first)]))
    assert fed[:3] == [32, 32, 6], "prefill chunks stop at the message end's and the prompt's checkpoints"
    branch = SYSTEM + USER_B
    fed.clear()
    second = llm.generate(prompt_token_ids=[branch], params=SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, message_ends=[len(SYSTEM), len(branch)]))[0]
    assert second.metrics.num_cached_tokens == 32
    assert sum(fed) == (len(branch) - 32) + 5, "only the tail after the message-end checkpoint is prefilled"
    cold = _greedy(LLM(str(folder), device="cpu", dtype="float32", enforce_eager=True, block_size=S,
                       enable_prefix_caching=False), branch, 6)
    assert second.token_ids == cold.token_ids == hf_greedy(ref, branch, 6)


def test_without_message_ends_a_branch_prefills_everything(hybrid: tuple[Path, torch.nn.Module]) -> None:
    """The control: with only the prompt-end checkpoint, the branch shares no checkpointed prefix."""
    folder, _ = hybrid
    llm = LLM(str(folder), device="cpu", dtype="float32", enforce_eager=True, block_size=S)
    _greedy(llm, SYSTEM + USER_A, 4)
    second = _greedy(llm, SYSTEM + USER_B, 6)
    assert second.metrics.num_cached_tokens == 0
