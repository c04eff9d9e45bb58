"""Host -> device copies of experts into cache slots, and the ordering that keeps them safe.

Two engines with one interface:
- `SyncTransfer` (CPU as the "device", or any device when asked): copies run at once (memcpy);
  the bookkeeping above it is the same as on the GPU, so CPU tests exercise it.
- `StreamTransfer` (CUDA): copies run on a dedicated copy stream; per slot, a *ready* event (its
  last copy landed) and a *free* event (the last kernel reading it finished).

Invariants kept here, for every slot s:
- the GPU never reads s before its copy finished: `wait(slots)` makes the compute stream wait
  on the ready events of the slots a kernel is about to read;
- a copy never overwrites s while a kernel may still read it: `fetch` makes the copy stream wait
  on s's free event, recorded by `mark_used` after the kernels reading s were enqueued;
- two copies into s never overlap: `fetch` also waits on s's ready event while one is pending.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Copy:
    """One contiguous copy: `dst.copy_(src)`, `nbytes` bytes."""

    src: torch.Tensor
    dst: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.src.numel() * self.src.element_size()


class Transfer(ABC):
    def __init__(self, device: torch.device | None = None) -> None:
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.bytes = 0
        self.copies = 0
        self._h2d_s = 0.0
        self._stall_s = 0.0

    @abstractmethod
    def fetch(self, copies: list[Copy], slots: list[int], demand: bool) -> None:
        """Start `copies`, which fill `slots`. demand: the current layer waits for them (a miss)."""

    @abstractmethod
    def wait(self, slots: list[int]) -> None:
        """Kernels issued from now on read `slots`: order them after the slots' copies."""

    @abstractmethod
    def mark_used(self, slots: list[int]) -> None:
        """Kernels reading `slots` have been issued; later copies into them must wait for those."""

    def busy(self, slot: int) -> bool:
        """Whether a kernel issued to read `slot` may still be pending (a copy into it would wait)."""
        return False

    def pending(self) -> set[int]:
        """Slots whose last copy has not landed yet (a kernel must not read them unordered)."""
        return set()

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A layer's small host-built input (slot ids, pair layout) on the device; kernels issued
        from now on may read it. Here: a plain copy."""
        return host.to(self.device, non_blocking=True)

    def seconds(self, block: bool = True) -> tuple[float, float]:
        """(time spent copying, time the computation waited for copies); block=False counts only
        what has finished, without waiting for copies in flight."""
        return self._h2d_s, self._stall_s

    def _count(self, copies: list[Copy]) -> None:
        self.copies += len(copies)
        self.bytes += sum(c.nbytes for c in copies)


class SyncTransfer(Transfer):
    """Copies at once on the calling thread; nothing is ever in flight."""

    def fetch(self, copies: list[Copy], slots: list[int], demand: bool) -> None:
        start = time.perf_counter()
        for c in copies:
            c.dst.copy_(c.src)
        spent = time.perf_counter() - start
        self._h2d_s += spent
        if demand:  # the layer could not start before these landed
            self._stall_s += spent
        self._count(copies)

    def wait(self, slots: list[int]) -> None:
        pass

    def mark_used(self, slots: list[int]) -> None:
        pass


class StreamTransfer(Transfer):
    """CUDA: copies on their own stream, ordered against the compute stream by events."""

    def __init__(self, device: torch.device, num_slots: int) -> None:
        super().__init__(device)
        self.stream = torch.cuda.Stream(device)
        self.ready: list[torch.cuda.Event | None] = [None] * num_slots
        self.in_flight: set[int] = set()  # slots whose ready event may still be pending (`pending`)
        self.free: list[torch.cuda.Event | None] = [None] * num_slots
        self.timed: deque[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = deque()  # (start, end, is_stall)

    def fetch(self, copies: list[Copy], slots: list[int], demand: bool) -> None:
        if not copies:
            return
        stream = self.stream
        with torch.cuda.stream(stream):
            # readers of the old contents are done, and so is a copy into the slot not yet read
            for ev in _distinct([*(self.free[s] for s in slots), *(self.ready[s] for s in slots)]):
                stream.wait_event(ev)
            start = self._event(stream)
            for c in copies:
                c.dst.copy_(c.src, non_blocking=True)
            done = self._event(stream)
        for s in slots:
            self.ready[s] = done
        self.in_flight.update(slots)
        self.timed.append((start, done, False))
        self._count(copies)
        self._drain()

    def wait(self, slots: list[int]) -> None:
        events = _distinct(self.ready[s] for s in slots)
        if not events:
            return
        compute = torch.cuda.current_stream(self.device)
        start = self._event(compute)
        for ev in events:
            compute.wait_event(ev)
        self.timed.append((start, self._event(compute), True))
        for s in slots:  # later kernels on the compute stream are ordered after these copies
            self.ready[s] = None

    def mark_used(self, slots: list[int]) -> None:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        for s in slots:
            self.free[s] = done

    def busy(self, slot: int) -> bool:
        ev = self.free[slot]
        return ev is not None and not ev.query()

    def pending(self) -> set[int]:
        landed: set[int] = set()  # ids of events found complete
        for s in list(self.in_flight):
            ev = self.ready[s]
            if ev is None or id(ev) in landed or ev.query():  # landed: nothing needs to wait for it any more
                if ev is not None:
                    landed.add(id(ev))
                self.ready[s] = None
                self.in_flight.discard(s)
        return set(self.in_flight)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """On the copy stream, behind the copies issued so far, and the compute stream waits for it.

        Invariant: a layer's inputs never queue behind a later layer's expert copies (on the compute
        stream, once the layer's own experts landed, its inputs and the next layer's copies were
        ready together, and the copy engine could take the large copy first)."""
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):  # allocated in this stream's pool: no pending compute reader
            out = host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        out.record_stream(compute)  # freed only once the compute stream's readers are done
        compute.wait_event(done)
        return out

    def seconds(self, block: bool = True) -> tuple[float, float]:
        self._drain(block=block)
        return super().seconds()

    @staticmethod
    def _event(stream: torch.cuda.Stream) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def _drain(self, block: bool = False) -> None:
        """Fold finished timing pairs into the totals (all of them when block)."""
        while self.timed and (block or self.timed[0][1].query()):
            start, end, is_stall = self.timed.popleft()
            end.synchronize()
            secs = start.elapsed_time(end) / 1e3
            if is_stall:
                self._stall_s += secs
            else:
                self._h2d_s += secs


def _distinct(events: Iterable[torch.cuda.Event | None]) -> list[torch.cuda.Event]:
    seen: dict[int, torch.cuda.Event] = {}
    for ev in events:
        if ev is not None:
            seen.setdefault(id(ev), ev)
    return list(seen.values())


def make_transfer(device: torch.device, num_slots: int) -> Transfer:
    """StreamTransfer on CUDA, SyncTransfer elsewhere (the CPU is its own device)."""
    return StreamTransfer(device, num_slots) if device.type == "cuda" else SyncTransfer(device)
