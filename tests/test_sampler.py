"""Sampler tests against transformers' logits processors and exact statistics."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ferryman.engine.sampler import Sampler, apply_filters, apply_penalties
from ferryman.engine.sequence import Sequence
from ferryman.sampling_params import SamplingParams

V = 512


def seqs_with(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence([3 * i + 1, 3 * i + 2, 7], p)
        seq.output_token_ids = list(outputs[i]) if outputs else []
        seqs.append(seq)
    return seqs


def hf_filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row through transformers' warpers, in `generate`'s order."""
    row = logits.unsqueeze(0)
    ids = torch.zeros(1, 1, dtype=torch.long)
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        warpers.append(MinPLogitsWarper(p.min_p))
    for w in warpers:
        row = w(ids, row)
    return row[0]


def test_greedy_is_argmax_even_next_to_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    tokens = Sampler()(logits, seqs_with(params))
    assert tokens.dtype == torch.int64 and tokens.shape == (6,)
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))
    all_greedy = Sampler()(logits, seqs_with([SamplingParams(temperature=0.0)] * 6))
    assert torch.equal(all_greedy, logits.argmax(-1))


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    torch.manual_seed(1)
    logits = torch.randn(3, V) * 3
    outputs = [[5, 9, 9], [], [400, 7]]
    params = [SamplingParams(repetition_penalty=penalty), SamplingParams(repetition_penalty=penalty),
              SamplingParams()]
    seqs = seqs_with(params, outputs)
    got = apply_penalties(logits, seqs)
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    for i, seq in enumerate(seqs[:2]):
        ids = torch.tensor([seq.all_token_ids])
        torch.testing.assert_close(got[i], proc(ids, logits[i:i + 1].clone())[0])
    assert torch.equal(got[2], logits[2])  # penalty 1.0 leaves the row alone


def test_presence_and_frequency_penalties_follow_openai_formula():
    torch.manual_seed(2)
    logits = torch.randn(2, V)
    outputs = [[4, 4, 4, 9], [1, 2]]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams()]
    got = apply_penalties(logits, seqs_with(params, outputs))
    # OpenAI: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, over output tokens.
    expected = logits[0].clone()
    for tok in set(outputs[0]):
        count = outputs[0].count(tok)
        expected[tok] -= count * 0.25 + 0.5
    torch.testing.assert_close(got[0], expected)
    assert torch.equal(got[1], logits[1])


FILTER_CASES = [
    SamplingParams(top_k=1),
    SamplingParams(top_k=20, temperature=0.7),
    SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.3, temperature=1.5),
    SamplingParams(min_p=0.05),
    SamplingParams(min_p=0.2, temperature=0.5),
    SamplingParams(top_k=50, top_p=0.8, min_p=0.02),
    SamplingParams(top_k=5, top_p=0.99),
    SamplingParams(),  # no filter in a batch where other rows filter
]


def test_filters_keep_exactly_the_transformers_support():
    torch.manual_seed(3)
    logits = torch.randn(len(FILTER_CASES), V) * 2
    temps = torch.tensor([p.temperature for p in FILTER_CASES]).unsqueeze(1)
    got = apply_filters(logits / temps, FILTER_CASES)
    for i, p in enumerate(FILTER_CASES):
        expected = hf_filtered(logits[i], p)
        kept = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(got[i]), kept), f"row {i}: {p}"
        torch.testing.assert_close(got[i][kept], expected[kept])


def test_sampled_tokens_stay_inside_the_support():
    torch.manual_seed(4)
    logits = torch.randn(1, V).expand(400, V).contiguous()
    params = [SamplingParams(top_k=3)] * 200 + [SamplingParams(top_p=0.5, seed=i) for i in range(200)]
    tokens = Sampler()(logits, seqs_with(params))
    assert set(tokens[:200].tolist()) == set(logits[0].topk(3).indices.tolist())
    support = torch.isfinite(hf_filtered(logits[0], SamplingParams(top_p=0.5))).nonzero().flatten()
    assert set(tokens[200:].tolist()) <= set(support.tolist())


def test_seed_gives_the_same_tokens_alone_and_inside_a_batch():
    torch.manual_seed(5)
    steps = [torch.randn(8, V) for _ in range(5)]
    p = SamplingParams(seed=1234, temperature=1.3, top_p=0.95)
    alone = seqs_with([p])
    alone_tokens = [Sampler()(logits[3:4], alone).item() for logits in steps]
    mixed_params = [SamplingParams(), SamplingParams(seed=99), SamplingParams(temperature=0), p,
                    SamplingParams(top_k=4), SamplingParams(seed=1234), SamplingParams(),
                    SamplingParams(repetition_penalty=1.2)]
    batch = seqs_with(mixed_params)
    batch_tokens = [Sampler()(logits, batch)[3].item() for logits in steps]
    assert batch_tokens == alone_tokens
    again = seqs_with([p])
    assert [Sampler()(logits[3:4], again).item() for logits in steps] == alone_tokens
    # A different seed gives a different stream (5 draws from a near-uniform 512-way choice).
    other = seqs_with([SamplingParams(seed=4321, temperature=1.3, top_p=0.95)])
    assert [Sampler()(logits[3:4], other).item() for logits in steps] != alone_tokens


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_frequencies(seeded):
    torch.manual_seed(6)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n, temperature = 6000, 0.7
    params = [SamplingParams(temperature=temperature, seed=i if seeded else None) for i in range(n)]
    tokens = Sampler()(base.expand(n, 5).contiguous(), seqs_with(params))
    freq = torch.bincount(tokens, minlength=5).double() / n
    expected = (base.double() / temperature).softmax(-1)
    # 4 standard errors of a binomial proportion at n = 6000 is < 0.026.
    assert torch.allclose(freq, expected, atol=4 * (0.25 / n) ** 0.5)
    assert not torch.allclose(freq, base.double().softmax(-1), atol=0.03)  # T=0.7 is not T=1


def test_masked_vocab_entries_are_never_sampled():
    logits = torch.full((300, 8), float("-inf"))
    logits[:, 2] = 0.0
    logits[:, 5] = 0.0
    tokens = Sampler()(logits, seqs_with([SamplingParams(min_p=0.1)] * 300))
    assert set(tokens.tolist()) == {2, 5}


def test_sample_runs_each_rows_processors_and_takes_logprobs_before_them():
    """Row 0 has a processor that forces token 5 (it sees its own output so far); row 1 has none
    and asks for logprobs; row 2 asks with a processor: its logprobs are the raw distribution's."""
    logits = torch.randn(3, V)
    seen: list[list[int]] = []

    def force_5(output_token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        seen.append(list(output_token_ids))
        return torch.full_like(row, float("-inf")).index_fill(0, torch.tensor([5]), 0.0)

    params = [SamplingParams(temperature=0.0, logits_processors=[force_5]),
              SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.0, logprobs=0, logits_processors=[force_5])]
    seqs = seqs_with(params, outputs=[[9, 8], [], [4]])
    out = Sampler().sample(logits.clone(), seqs)
    ids = [s.seq_id for s in seqs]
    assert out.token_ids == {ids[0]: 5, ids[1]: logits[1].argmax().item(), ids[2]: 5}
    assert seen == [[9, 8], [4]]
    assert set(out.logprobs) == {ids[1], ids[2]}
    logp = logits.log_softmax(-1)
    chosen, top = out.logprobs[ids[1]]
    assert chosen == pytest.approx(logp[1].max().item()) and [t for t, _ in top] == logp[1].topk(2).indices.tolist()
    assert out.logprobs[ids[2]] == (pytest.approx(logp[2, 5].item()), [])


def test_bad_logits_shape_raises():
    with pytest.raises(ValueError, match="B = 2"):
        Sampler()(torch.zeros(3, V), seqs_with([SamplingParams()] * 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_support_and_seeds():
    torch.manual_seed(7)
    logits = torch.randn(len(FILTER_CASES), V) * 2
    temps = torch.tensor([p.temperature for p in FILTER_CASES]).unsqueeze(1)
    cpu = apply_filters(logits / temps, FILTER_CASES)
    gpu_logits = (logits / temps).cuda()
    gpu = apply_filters(gpu_logits, FILTER_CASES)
    assert torch.equal(torch.isfinite(gpu.cpu()), torch.isfinite(cpu))
    p = SamplingParams(seed=11)
    a = Sampler()(logits[:1].cuda(), seqs_with([p]))
    others = [SamplingParams()] * (len(FILTER_CASES) - 1)
    b = Sampler()(logits.cuda(), seqs_with([SamplingParams(seed=11)] + others))
    assert a.item() == b[0].item()
