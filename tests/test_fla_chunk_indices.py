"""delta_rule.chunk_indices equals flash-linear-attention's own prepare_chunk_indices (computed on
the host, so the chunk kernel reads no lengths back from the device)."""

from __future__ import annotations

import pytest
import torch

from ferryman.layers.delta_rule import FLA_CHUNK, chunk_indices


def _reference(starts: list[int], chunk: int) -> list[tuple[int, int]]:
    return [(b, i) for b in range(len(starts) - 1) for i in range(-(-(starts[b + 1] - starts[b]) // chunk))]


@pytest.mark.parametrize("starts", [[0, 1], [0, 64], [0, 65], [0, 208, 216], [0, 3, 3, 200, 8392]])
def test_chunk_indices_rows(starts: list[int]) -> None:
    got = chunk_indices(starts)
    assert got.dtype == torch.long and got.shape == (len(_reference(starts, FLA_CHUNK)), 2)
    assert [tuple(r) for r in got.tolist()] == _reference(starts, FLA_CHUNK)


@pytest.mark.parametrize("starts", [[0, 1], [0, 65], [0, 208, 216], [0, 3, 3, 200, 8392]])
def test_chunk_indices_equal_fla(starts: list[int]) -> None:
    index = pytest.importorskip("fla.ops.utils.index")
    want = index.prepare_chunk_indices(torch.tensor(starts), FLA_CHUNK)
    assert torch.equal(chunk_indices(starts), want)
