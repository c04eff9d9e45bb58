"""The one device -> host read of a layer step: the experts its tokens use, and its guesses'."""

from __future__ import annotations

import itertools

import numpy as np
import torch


def host_ids_of(topk_ids: torch.Tensor,
                guesses: list[torch.Tensor]) -> tuple[list[int], list[list[int]], torch.Tensor]:
    """Distinct expert ids used (ascending), and of each guess (decode-sized: in the guess's order,
    a token's most likely first; else ascending), and topk_ids on the host: one device -> host copy
    for all."""
    parts = [topk_ids.reshape(-1), *(g.reshape(-1).to(topk_ids.dtype) for g in guesses)]
    host = (torch.cat(parts) if guesses else parts[0]).cpu()
    bounds = [0, *itertools.accumulate(p.numel() for p in parts)]
    if host.numel() <= 512:  # decode-sized: Python sets beat tensor ops on a few ids
        values = host.tolist()
        distinct = [sorted(set(values[a:b])) if i == 0 else list(dict.fromkeys(values[a:b]))
                    for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    else:
        distinct = [distinct_ids(host[a:b]) for a, b in zip(bounds, bounds[1:])]
    n = topk_ids.numel()
    return distinct[0], distinct[1:], host[:n].view(topk_ids.shape)


def distinct_ids(ids: torch.Tensor) -> list[int]:
    """Distinct values of host ids [N], ascending: a bincount for expert ids (>= 0; torch.unique's
    CPU sort of a 16k-token prefill's 64k ids costs about a millisecond a layer)."""
    a = ids.numpy()
    if a.size and a.min() >= 0:
        return np.flatnonzero(np.bincount(a)).tolist()
    return np.unique(a).tolist()
