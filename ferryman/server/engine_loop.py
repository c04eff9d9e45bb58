"""The engine in its own thread: requests in through a command queue, their deltas out to asyncio.

The HTTP event loop never touches `LLMEngine`; it submits and aborts through `EngineLoop`, which
hands commands to the engine thread. Between two steps the engine thread adds and aborts requests,
then runs one `LLMEngine.step()` and posts each request's new tokens to that request's asyncio
queue (`loop.call_soon_threadsafe`). Tokenising, HTTP and streaming therefore never stall a step.

Failure: if a step raises, the thread exits, or a step runs longer than `step_timeout_s`
(`--step-timeout`; the watchdog logs at ERROR what the engine thread was running), the loop is
*dead*: every pending request gets an `EngineDeadError` at once, new submissions are refused, and
`/health` answers 503. A dead loop is never restarted. Shutdown (`end_pending`, then `shutdown`)
ends what is still running with a `ShutdownError`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ferryman.engine.llm_engine import LLMEngine
from ferryman.engine.outputs import RequestOutput, StepDelta
from ferryman.errors import EngineDeadError, FerrymanError
from ferryman.sampling_params import SamplingParams

log = logging.getLogger("ferryman.server")
T = TypeVar("T")


def on_a_passing_thread(fn: Callable[[], T]) -> T:
    """fn()'s result (or its exception), computed on a thread that ends with it.

    The engine loads and warms up here, not on the main thread: an OpenMP runtime (torch's CPU ops,
    the CPU expert kernel) keeps a team of threads for every thread that ran a parallel region until
    that thread ends, and once its teams hold more threads than the machine has cores, every region
    and barrier sleeps instead of spinning. With a team left on the main thread, the engine thread's
    CPU decode ran 2.2x slower (docs/benchmarks.md); this thread's team ends with it."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            err.append(e)

    # daemon: Ctrl-C ends the process at once (an executor's worker would hold the exit until the load ends)
    thread = threading.Thread(target=run, name="ferryman-load", daemon=True)
    thread.start()
    thread.join()
    if err:
        raise err[0]
    return out[0]

_IDLE_WAIT_S = 0.05  # how long an idle engine thread blocks on the command queue
_WATCHDOG_PERIOD_S = 0.2
_STATS_PERIOD_S = 0.2  # /v1/stats and /metrics lag a busy engine by at most this much
# An idle engine that receives a request waits this long for more before its first step, as long
# as they keep coming at most _GATHER_GAP_S apart. With offloaded experts a prefill step streams
# every uncached expert once whatever its length, so requests that arrive together (agents, a
# page of users) are prefilled in one step instead of one step each.
_GATHER_WINDOW_S = 0.03
_GATHER_GAP_S = 0.005


class OverloadedError(FerrymanError):
    """The request queue is full (HTTP 429)."""


class ShutdownError(EngineDeadError):
    """The server is shutting down: what is still running is ended (HTTP 503)."""

    def __init__(self, reason: str) -> None:
        FerrymanError.__init__(self, reason)  # not "engine is dead": the engine is fine


@dataclass(eq=False)
class RequestHandle:
    """One submitted request: iterate it (in the event loop) for its StepDeltas."""

    key: int
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    rid: int | None = None  # engine request id, set by the engine thread
    last_token_time: float | None = None
    output: RequestOutput | None = None  # the final output (metrics), set before the last delta is posted
    finished: bool = False

    def post(self, item: StepDelta | BaseException) -> None:
        """Thread-safe: hand an event (or the error that ends the request) to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def events(self) -> AsyncIterator[StepDelta]:
        """StepDeltas until the one with finish_reason; raises the error that ends the request."""
        while not self.finished:
            item = await self.queue.get()
            self.finished = isinstance(item, BaseException) or item.finish_reason is not None
            if isinstance(item, BaseException):
                raise item
            yield item


class LoopObserver(Protocol):
    """Metrics hooks, called from the engine thread."""

    def on_token(self, handle: RequestHandle, now: float, first: bool) -> None: ...

    def on_finish(self, handle: RequestHandle, output: RequestOutput) -> None: ...


class EngineLoop:
    def __init__(self, engine: LLMEngine, max_pending: int = 256, step_timeout_s: float = 600.0) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.step_timeout_s = step_timeout_s
        self.observer: LoopObserver | None = None  # ServerMetrics.attach sets it
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._keys = itertools.count()
        self._lock = threading.Lock()
        # Invariant: a handle is in _pending from submit() until its last event or error is posted.
        self._pending: dict[int, RequestHandle] = {}  # by key
        self._by_rid: dict[int, RequestHandle] = {}  # engine-thread only
        self._fault: BaseException | None = None
        self._stop = threading.Event()
        self._step_started: float | None = None
        self.dead_reason: str | None = None
        self.stats_snapshot: dict[str, Any] = engine.stats()
        self._stats_time = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ferryman-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="ferryman-watchdog", daemon=True)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._watchdog.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._fail_all(ShutdownError("the server is shutting down"))

    def end_pending(self, reason: str) -> int:
        """End every request in flight with a ShutdownError(reason) and abort it in the engine;
        returns how many. New submissions are still taken (the caller stops them first)."""
        with self._lock:
            handles = list(self._pending.values())
        for h in handles:
            self.abort(h)
        self._fail_all(ShutdownError(reason))
        return len(handles)

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self._thread.is_alive()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def inject_fault(self, exc: BaseException) -> None:
        """Testing hook (not reachable over HTTP): the next engine step raises `exc`."""
        self._fault = exc
        self._commands.put(("wake", None))

    # ---- intake (event-loop thread) ------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestHandle:
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "the engine thread is not running")
        with self._lock:
            if len(self._pending) >= self.max_pending:
                raise OverloadedError(f"the server has {len(self._pending)} requests in flight "
                                      f"(limit {self.max_pending}); retry later")
            handle = RequestHandle(next(self._keys), list(prompt_token_ids), params, asyncio.get_running_loop())
            self._pending[handle.key] = handle
        self._commands.put(("add", handle))
        return handle

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Run fn(engine) on the engine thread between two steps (admin: live memory bounds); the
        future gets its result, or the ValueError / FerrymanError it raised."""
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "the engine thread is not running")
        aloop = asyncio.get_running_loop()
        future = aloop.create_future()
        self._commands.put(("call", (fn, future, aloop)))
        return future

    def abort(self, handle: RequestHandle) -> None:
        """Stop a request (client gone): its blocks are freed before the next step."""
        if not handle.finished:
            self._commands.put(("abort", handle))

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.dead_reason is None:
                idle = not self.engine.has_unfinished()
                if self._drain_commands(block=idle):
                    if idle:
                        self._gather()
                    self._refresh_stats()
                if self._fault is not None:
                    raise self._fault
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # noqa: BLE001 - any failure kills the loop, reported to all
            log.exception("engine loop died")
            self._die(f"{type(e).__name__}: {e}")

    def _drain_commands(self, block: bool) -> int:
        """Apply queued adds / aborts; returns how many."""
        done = 0
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            while True:
                self._apply(*cmd)
                done += 1
                cmd = self._commands.get_nowait()
        except queue.Empty:
            return done

    def _gather(self) -> None:
        """The engine was idle and got work: take the requests that arrive right behind it."""
        end = time.monotonic() + _GATHER_WINDOW_S
        while (left := end - time.monotonic()) > 0:
            try:
                cmd = self._commands.get(timeout=min(_GATHER_GAP_S, left))
            except queue.Empty:
                return
            self._apply(*cmd)

    def _apply(self, kind: str, handle: Any) -> None:
        if kind == "add":
            self._add(handle)
        elif kind == "call":
            self._call(*handle)
        elif kind == "abort" and handle.rid is not None and handle.rid in self._by_rid:
            self.engine.abort(handle.rid)
            self._close(handle, StepDelta(handle.rid, [], "", "abort"))

    def _add(self, handle: RequestHandle) -> None:
        try:
            handle.rid = self.engine.add_request(handle.prompt_token_ids, handle.params)
        except (ValueError, FerrymanError) as e:
            self._finish_handle(handle, e)
            return
        self._by_rid[handle.rid] = handle

    def _call(self, fn: Callable[[LLMEngine], Any], future: asyncio.Future, aloop: asyncio.AbstractEventLoop) -> None:
        try:
            result, error = fn(self.engine), None
        except (ValueError, FerrymanError) as e:
            result, error = None, e

        def settle() -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)

        aloop.call_soon_threadsafe(settle)

    def _step(self) -> None:
        self._step_started = time.monotonic()
        deltas = self.engine.step()
        self._step_started = None
        if self.dead_reason is not None:
            return  # the watchdog gave up on this step; its requests were already failed
        now = time.monotonic()
        for d in deltas:
            handle = self._by_rid.get(d.request_id)
            if handle is not None:
                self._deliver(handle, d, now)
        # statistics are for monitoring: refresh them at most every _STATS_PERIOD_S while busy, and
        # always once the work runs out
        if now - self._stats_time >= _STATS_PERIOD_S or not self.engine.has_unfinished():
            self._refresh_stats()

    def _refresh_stats(self) -> None:
        # block=False: waiting for the copies in flight would stall the pipeline every refresh
        self.stats_snapshot = self.engine.stats(block=False)
        self._stats_time = time.monotonic()

    def _deliver(self, handle: RequestHandle, d: StepDelta, now: float) -> None:
        if self.observer is not None:
            self.observer.on_token(handle, now, first=handle.last_token_time is None)
        handle.last_token_time = now
        if d.finish_reason is None:
            handle.post(d)
        else:
            self._close(handle, d)

    def _close(self, handle: RequestHandle, last: StepDelta) -> None:
        """Last delta of a request: keep its final output, forget it everywhere."""
        assert handle.rid is not None
        handle.output = self.engine.pop_output(handle.rid)
        self._by_rid.pop(handle.rid, None)
        if self.observer is not None and handle.output is not None:
            self.observer.on_finish(handle, handle.output)
        self._finish_handle(handle, last)

    def _finish_handle(self, handle: RequestHandle, item: StepDelta | BaseException) -> None:
        with self._lock:
            self._pending.pop(handle.key, None)
        handle.post(item)

    # ---- failure -------------------------------------------------------------------------------
    def _die(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        self._fail_all(EngineDeadError(self.dead_reason))

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            handles = list(self._pending.values())
            self._pending.clear()
        for h in handles:
            h.post(error)

    def _watch(self) -> None:
        """Watchdog: a thread that exited or a step that hangs makes the loop dead."""
        while not self._stop.wait(_WATCHDOG_PERIOD_S):
            if self.dead_reason is not None:
                return
            started = self._step_started
            if not self._thread.is_alive():
                self._die("the engine thread exited")
            elif started is not None and time.monotonic() - started > self.step_timeout_s:
                log.error("watchdog: an engine step has run for more than %g s (--step-timeout) with %d "
                          "requests in flight (%d running, %d waiting); the engine thread is at %s; the engine "
                          "is now dead and every request fails", self.step_timeout_s, len(self._pending),
                          self.stats_snapshot.get("num_running", 0), self.stats_snapshot.get("num_waiting", 0),
                          self._engine_stack())
                self._die(f"an engine step has run for more than {self.step_timeout_s:g} s")

    def _engine_stack(self, depth: int = 4) -> str:
        """Where the engine thread is now: its innermost frames, innermost last, on one line."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        if frame is None:
            return "an unknown place"
        frames = traceback.extract_stack(frame)[-depth:]
        return " > ".join(f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in frames)
