"""One sequence's long prompt chunk through cuDNN (layers/attention_long_chunk.py): its two parts (the
earlier keys with grouped heads stacked as rows, the causal square of its own keys) merged with the
sinks equal the reference. On the CPU the same code runs with torch's CPU flash op in cuDNN's place."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import ferryman.layers.attention_long_chunk as lc
from ferryman.layers.paged_attention import paged_attention, paged_attention_reference
from test_paged_attention import GPT_OSS, gpu, make_batch


def cpu_attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out[0], out[1]


@pytest.mark.parametrize("cached", [0, 37, 300])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_two_parts_merged_equal_the_reference(cached: int, use_sinks: bool) -> None:
    """A chunk of 90 rows after `cached` earlier positions (blocks of 16, shuffled), 8 query heads on
    2 kv heads: within fp32 rounding of the reference's dense scores."""
    batch = make_batch([(cached + 90, 90)], hq=8, hkv=2, d=16, seed=cached + 3)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(5)) if use_sinks else None
    want = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25, None, sinks)
    got = lc.attend_long_chunk(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25, sinks, attend=cpu_attend)
    assert got is not None and got.dtype == batch.q.dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_refusal_returns_none_and_turns_the_path_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lc, "_refused", [])

    def refuse(*args: object) -> tuple[Tensor, Tensor]:
        raise RuntimeError("cuDNN Frontend error: no engine for this graph\nmore")

    batch = make_batch([(120, 60)], hq=4, hkv=1, d=16, seed=1)
    assert lc.attend_long_chunk(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25, None, attend=refuse) is None
    assert lc._refused == ["cuDNN Frontend error: no engine for this graph"]


def test_the_cpu_and_short_or_windowed_steps_keep_their_kernels() -> None:
    long = make_batch([(3000, 2048)], hq=4, hkv=1, d=16, seed=2)
    assert not lc.applies(long.q, long.k_cache, long.meta, None)  # q on the CPU


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("specs", [[(6000, 2048)], [(2048, 2048)]])
def test_cuda_long_chunk_takes_cudnn_and_matches_the_reference(specs: list[tuple[int, int]]) -> None:
    """gpt-oss shapes in bf16, sinks: `paged_attention` takes the cuDNN path for one sequence's 2,048
    rows (after 3,952 cached positions, and alone), within bf16 rounding of the reference; a
    sliding window, two sequences or fewer rows keep the paged kernel."""
    batch = make_batch(specs, seed=31, **GPT_OSS)
    sinks = torch.randn(64, device="cuda")
    assert lc.applies(batch.q, batch.k_cache, batch.meta, None) and not lc._refused
    direct = lc.attend_long_chunk(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, sinks)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, None, sinks)
    assert direct is not None and torch.equal(out, direct)
    ref = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, None, sinks)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert not lc.applies(batch.q, batch.k_cache, batch.meta, 128)
    two = make_batch([(3000, 1500), (40, 1)], seed=32, **GPT_OSS)
    short = make_batch([(3000, 1000)], seed=33, **GPT_OSS)
    assert not lc.applies(two.q, two.k_cache, two.meta, None) and not lc.applies(short.q, short.k_cache, short.meta, None)
