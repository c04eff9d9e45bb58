"""experts/routing.py: the distinct expert ids of a layer step equal torch.unique's, at both sizes."""

from __future__ import annotations

import pytest
import torch

from ferryman.experts.routing import distinct_ids, host_ids_of


@pytest.mark.parametrize("ids", [torch.randint(0, 300, (5000,)), torch.tensor([], dtype=torch.long),
                                 torch.tensor([-1, 5, 5, 3]), torch.tensor([7], dtype=torch.int32)])
def test_distinct_ids_equal_unique(ids: torch.Tensor) -> None:
    assert distinct_ids(ids) == torch.unique(ids).tolist()


@pytest.mark.parametrize("tokens", [4, 1000])  # the decode-sized set path and the prefill-sized one
def test_host_ids_of_reads_ids_and_guesses(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, 64, (tokens, 4), generator=g).int()
    guess = torch.randint(0, 64, (300,), generator=g)
    used, guesses, host = host_ids_of(ids, [guess])
    assert used == torch.unique(ids).tolist() and torch.equal(host, ids)
    assert sorted(guesses[0]) == torch.unique(guess).tolist()


@pytest.mark.parametrize("tokens", [3, 300])
def test_a_routing_read_started_early_gives_what_host_ids_of_gives(tokens: int) -> None:
    from ferryman.experts.routing import RoutingRead

    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(32, generator=gen)[:4] for _ in range(tokens)]).int()
    guess = torch.randint(0, 32, (tokens, 2), generator=gen)
    got, want = RoutingRead(ids, [guess]).result(), host_ids_of(ids, [guess])
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])
