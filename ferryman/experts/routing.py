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
    return _split(host, [p.numel() for p in parts], topk_ids.shape)


class RoutingRead:
    """`host_ids_of`, started now and finished later: the ids (and the guesses') are copied into
    pinned host memory behind the kernels issued so far, and `result` waits for that copy only, not
    for kernels issued after it (a layer-major layer's later chunks). On the CPU: read at once."""

    def __init__(self, topk_ids: torch.Tensor, guesses: list[torch.Tensor]) -> None:
        parts = [topk_ids.reshape(-1), *(g.reshape(-1).to(topk_ids.dtype) for g in guesses)]
        flat = torch.cat(parts) if guesses else parts[0]
        self.sizes, self.shape = [p.numel() for p in parts], topk_ids.shape
        self.done: torch.cuda.Event | None = None
        if flat.is_cuda:
            self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = flat

    def result(self) -> tuple[list[int], list[list[int]], torch.Tensor]:
        """What `host_ids_of` returns, once the copy landed."""
        if self.done is not None:
            self.done.synchronize()
        return _split(self.host, self.sizes, self.shape)


def _split(host: torch.Tensor, sizes: list[int],
           shape: torch.Size) -> tuple[list[int], list[list[int]], torch.Tensor]:
    """host: the ids then each guess's, flat -> (distinct used, distinct of each guess, ids [T, K])."""
    bounds = [0, *itertools.accumulate(sizes)]
    if host.numel() <= 512:  # decode-sized: Python sets beat tensor ops on a few ids
        values = host.tolist()
        distinct = [sorted(set(values[a:b])) if i == 0 else list(dict.fromkeys(values[a:b]))
                    for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    else:
        distinct = [distinct_ids(host[a:b]) for a, b in zip(bounds, bounds[1:])]
    return distinct[0], distinct[1:], host[: sizes[0]].view(shape)


def distinct_ids(ids: torch.Tensor) -> list[int]:
    """Distinct values of host ids [N], ascending: a bincount for expert ids (>= 0; torch.unique's
    CPU sort of a 16k-token prefill's 64k ids costs about a millisecond a layer)."""
    a = ids.numpy()
    if a.size and a.min() >= 0:
        return np.flatnonzero(np.bincount(a)).tolist()
    return np.unique(a).tolist()
