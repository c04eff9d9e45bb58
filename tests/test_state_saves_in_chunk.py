"""State checkpoints saved inside a prefill chunk (kvcache/state_checkpoints.py): a chunk runs past
its checkpoint positions in one step, and the state it saves there equals the state a run split at
the position leaves (CPU, fp32): for the gated delta rule's segment rounds (the scheme the fla
kernels run on the GPU), for a gated DeltaNet layer's conv and recurrent state at any offset, and for
a whole hybrid engine against one whose chunks end at the checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferryman import LLM, SamplingParams
from ferryman.layers.attn_metadata import AttnMetadata, StateMetadata
from ferryman.layers.delta_rule import delta_rule_cut, delta_rule_torch
from ferryman.layers.gated_deltanet import GatedDeltaNet
from tiny_models import build_tiny

S = 16  # block size
SYSTEM = [(i * 29) % 250 + 3 for i in range(40)]  # a first message: ends at 40, checkpoint at 32
USER = [(i * 13) % 250 + 3 for i in range(30)]  # the prompt ends at 70: checkpoint at 64


def _inputs(lens: list[int], hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):  # noqa: ANN202
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k = (torch.randn(T, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(T, hv, dv, generator=gen)
    g = -torch.rand(T, hv, generator=gen)  # log decay
    beta = torch.rand(T, hv, generator=gen)
    init = torch.randn(len(lens), hv, dk, dv, generator=gen)
    starts = [sum(lens[:i]) for i in range(len(lens) + 1)]
    return q, k, v, g, beta, starts, init


def test_segment_rounds_equal_separate_runs() -> None:
    """Sequences with no, one and two cuts (one right after the start, one of a single token): the
    outputs, final states and states at the cuts equal each segment run on its own, chained."""
    lens, cuts = [70, 5, 130], [[64], [], [1, 129]]
    q, k, v, g, beta, starts, init = _inputs(lens)
    o, final, mids = delta_rule_cut(q, k, v, g, beta, starts, cuts, init, delta_rule_torch)
    for b in range(len(lens)):
        state, bounds = init[b:b + 1], [starts[b], *(starts[b] + c for c in cuts[b]), starts[b + 1]]
        for j, (s, e) in enumerate(zip(bounds, bounds[1:])):
            part = (t[s:e] for t in (q, k, v, g, beta))
            o_ref, state = delta_rule_torch(*part, [0, e - s], state)
            torch.testing.assert_close(o[s:e], o_ref, rtol=1e-5, atol=1e-6)
            if j < len(cuts[b]):
                torch.testing.assert_close(mids[b][j], state[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(final[b], state[0], rtol=1e-5, atol=1e-6)
        assert len(mids[b]) == len(cuts[b])


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_next_saves")
    build_tiny("qwen3_next", folder)
    return folder


def _llm(folder: Path, **kw: object) -> LLM:
    return LLM(str(folder), **({"device": "cpu", "dtype": "float32"} | kw), enforce_eager=True, block_size=S)


def _meta(lens: list[int], slots: list[int], fresh: list[bool], saves: list[list[tuple[int, int]]] | None) -> AttnMetadata:
    starts = [sum(lens[:i]) for i in range(len(lens) + 1)]
    qsl, none = torch.tensor(starts, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    state = StateMetadata(torch.tensor(slots), torch.tensor(fresh), starts, slots, fresh, saves)
    return AttnMetadata(qsl, none, none.view(0, 0), none.long(), max(lens), 0, state=state)


def _bind(layer: GatedDeltaNet, conv: torch.Tensor, ssm: torch.Tensor) -> None:
    layer.conv_state, layer.ssm_state = conv.clone(), ssm.clone()
    layer.checkpoint_conv, layer.checkpoint_ssm = torch.zeros_like(conv), torch.zeros_like(ssm)


@torch.inference_mode()
def test_layer_saves_the_state_split_runs_leave(hybrid: Path) -> None:
    """A gated DeltaNet layer saving at offsets 1, 2 (the conv state then holds inputs of the previous
    step), 37 and 50 of two chunks leaves in its checkpoints the states of runs split there, and the
    same outputs and final states as a run without saves."""
    layer = _llm(hybrid).engine.runner.model.linear_layers()[0]
    conv, ssm = layer.conv_state, layer.ssm_state  # [N, C, K-1], [N, Hv, Dk, Dv]
    gen = torch.Generator().manual_seed(1)
    conv, ssm = torch.randn(conv.shape, generator=gen), torch.randn(ssm.shape, generator=gen)
    lens, x = [60, 45], torch.randn(105, layer.out_proj.out_features, generator=gen)
    saves = [[(2, 0), (37, 1)], [(1, 2), (44, 3)]]  # slot 0 starts fresh, slot 1 continues its state
    _bind(layer, conv, ssm)
    plain = layer(None, x, _meta(lens, [0, 1], [True, False], None))
    finals = layer.conv_state.clone(), layer.ssm_state.clone()
    _bind(layer, conv, ssm)
    out = layer(None, x, _meta(lens, [0, 1], [True, False], saves))
    torch.testing.assert_close(out, plain)
    torch.testing.assert_close((layer.conv_state, layer.ssm_state), finals)
    saved = layer.checkpoint_conv.clone(), layer.checkpoint_ssm.clone()
    for b, (start, fresh) in enumerate([(0, True), (60, False)]):
        for at, checkpoint in saves[b]:  # the reference: the first `at` tokens alone, in a step of their own
            _bind(layer, conv, ssm)
            layer(None, x[start:start + at], _meta([at], [b], [fresh], None))
            torch.testing.assert_close(saved[0][checkpoint], layer.conv_state[b], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(saved[1][checkpoint], layer.ssm_state[b], rtol=1e-5, atol=1e-5)


def _saved(llm: LLM, tokens: list[int], at: int) -> list[torch.Tensor]:
    """The conv and recurrent checkpoint of every linear layer for the prefix tokens[:at]."""
    from ferryman.engine.sequence import Sequence

    hashes = Sequence(tokens)
    llm.engine.scheduler.pool.match_sequence(hashes)  # computes the block hashes
    slot = llm.engine.scheduler.checkpoints.find(hashes.block_hashes[at // S - 1])
    assert slot is not None, f"no checkpoint at {at}"
    return [t[slot] for pair in llm.engine.runner.checkpoints.saved for t in pair]


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"),
                                           pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu)])
def test_one_step_saves_what_split_steps_save(hybrid: Path, device: str, dtype: str) -> None:
    """A 70-token prompt with a message end at 40 runs in one prefill step (was 32, 32, 6) and saves
    at 32 and 64 the states an engine whose chunks end there (32-token steps) saves after its steps.
    On the GPU (bf16, the fla kernels in segment rounds) within bf16's rounding of the activations."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, message_ends=[40, 70])
    prompt, kw = SYSTEM + USER, dict(device=device, dtype=dtype)
    one = _llm(hybrid, **kw)
    steps = []
    inner = one.engine.runner.execute
    one.engine.runner.execute = lambda out: (steps.append(out.num_batched_tokens), inner(out))[1]
    a = one.generate(prompt_token_ids=[prompt], params=params)[0]
    assert steps == [70, 1, 1], "one prefill step, then decodes"
    split = _llm(hybrid, max_num_batched_tokens=32, **kw)
    b = split.generate(prompt_token_ids=[prompt], params=params)[0]
    if device == "cpu":
        assert a.token_ids == b.token_ids
    for at in (32, 64):
        for mine, theirs in zip(_saved(one, prompt, at), _saved(split, prompt, at), strict=True):
            if device == "cpu":
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
            else:
                assert ((mine.float() - theirs.float()).norm() / theirs.float().norm()).item() < 2e-2
