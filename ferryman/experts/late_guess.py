"""Late decode prefetch (FERRYMAN_DECODE_PREFETCH=late, late2): guesses made after a MoE layer from
the residual stream it leaves, their ids read back without blocking the host, their copies started
by the next MoE layer's step.

Per decode step and MoE layer L:
1. after L's MoE kernel, the next layer's router on its own norm of the residual guesses L+1's
   experts (late2: and L+2's through L+2's router); in layer-graph decode the MoE graph computes
   them (`made`), after an eager MoE `after` does; the ids [D, B, K] come to the host in one copy;
2. L+1's step (`take`, before its sync) waits for that copy only and starts the copies of its own
   guessed experts; late2's guesses for L+2 wait until L+1's kernel and its small host -> device
   inputs are issued (`issue_deferred`, called by `OffloadExperts.finish_step`), then go on the
   transfer's side stream;
3. late2 holds (pins) every guessed expert until its layer's acquire, so the layer in between
   cannot evict it (`ExpertCache.prefetch(hold=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferryman.experts.gpu_cache import ExpertCache
from ferryman.experts.prefetch import NextLayerGuesser


@dataclass(frozen=True)
class LateGuess:
    """Late decode guesses made after one MoE layer, taken by the next MoE layer's step (`at`)."""

    at: int
    guesses: list[tuple[int, int, torch.Tensor]]  # (target MoE layer, layers ahead, ids [B, K] on the host)
    done: torch.cuda.Event | None  # the ids' copy to the host has landed (CUDA)


class LateGuesses:
    """The late guesses of one offloaded backend; inert when `guesser` is None (late prefetch off)."""

    def __init__(self, cache: ExpertCache, guesser: NextLayerGuesser | None) -> None:
        self.cache, self.guesser = cache, guesser
        self.pending: LateGuess | None = None
        self.deferred: list[tuple[int, int, torch.Tensor]] = []  # late2 guesses waiting for issue_deferred

    def after(self, layer: int, residual: torch.Tensor) -> None:
        """After `layer`'s MoE kernels are issued: guess the next MoE layer's experts (late2: and the
        layer after's) from the residual stream [B, H] that follows them."""
        targets = self._targets(layer)
        if not targets or self.guesser is None:
            return
        guesses = [self.guesser.guess_residual(layer, residual, d) for d, _ in targets]
        self._read(layer, targets, torch.stack([g[1] for g in guesses if g is not None]))  # [D, B, K]

    def made(self, layer: int, ids: torch.Tensor) -> None:
        """The guesses of `layer` computed elsewhere (inside its MoE CUDA graph): ids [D, B, K], row
        d - 1 the guess for the MoE layer d after `layer`, for every d up to the guess depth."""
        targets = self._targets(layer)
        if targets:
            rows = [d - 1 for d, _ in targets]
            self._read(layer, targets, ids if rows == list(range(ids.shape[0])) else ids[rows])

    def take(self, layer: int) -> None:
        """`layer`'s step begins (before its sync): start the copies of its own guessed experts;
        guesses for later layers wait for `issue_deferred`."""
        pending, self.pending = self.pending, None
        if pending is None or pending.at != layer or self.guesser is None:
            return
        if pending.done is not None:
            pending.done.synchronize()  # the guess kernels only: they ran right after the last MoE layer
        for target, depth, ids in pending.guesses:
            if depth == 1:
                self._prefetch(target, depth, ids)
            else:
                self.deferred.append((target, depth, ids))

    def issue_deferred(self) -> None:
        """The current layer's kernel and its inputs are issued: start the later layers' copies."""
        deferred, self.deferred = self.deferred, []
        for target, depth, ids in deferred:
            self._prefetch(target, depth, ids)

    def _targets(self, layer: int) -> list[tuple[int, int]]:
        """(layers ahead, target MoE layer) of the guesses after `layer` that may prefetch."""
        guesser = self.guesser
        if guesser is None:
            return []
        return [(d, t) for d in range(1, guesser.late_depth + 1)
                if (t := guesser.ahead(layer, d)) is not None and guesser.wants_prefetch(t, False)]

    def _read(self, layer: int, targets: list[tuple[int, int]], ids: torch.Tensor) -> None:
        """Start reading ids [len(targets), B, K] back to the host (one copy, an event on CUDA)."""
        done = None
        if ids.device.type == "cuda":
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(ids.device))
            ids = host
        assert self.guesser is not None  # _targets found some
        self.pending = LateGuess(self.guesser.next_of[layer], [(t, d, ids[j]) for j, (d, t) in enumerate(targets)],
                                 done)

    def _prefetch(self, target: int, depth: int, ids: torch.Tensor) -> None:
        assert self.guesser is not None  # a guess was made
        guessed = sorted(set(ids.reshape(-1).tolist()))
        fetched = self.cache.prefetch(target, guessed, depth, hold=self.guesser.late_depth > 1, side=depth > 1)
        self.guesser.remember(target, guessed, fetched, False)
