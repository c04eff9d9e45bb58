"""Graceful drain: SIGTERM (or Ctrl-C) stops new work, lets running requests finish, then exits 0.

    signal ─> draining: new requests 503, /health 503 {"status": "draining"} (the port stays open,
              so clients get an answer instead of a refused connection)
           ─> wait until no HTTP request is in progress, at most drain_timeout_s (--drain-timeout)
           ─> still running: each ends with an error event (OpenAI: then `data: [DONE]`; Anthropic:
              `event: error`), a whole response with 503
           ─> engine loop stopped, uvicorn shuts down, the process exits 0

A second signal stops at once (uvicorn's forced exit). `DrainingServer` is uvicorn's Server with
that signal handling; the drain itself is `drain()`, which tests call directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn

from ferryman.server.state import ServerState

log = logging.getLogger("ferryman.server")

_POLL_S = 0.05
_FLUSH_S = 5.0  # after the drain period: how long ended streams get to write their last event


async def _wait_idle(state: ServerState, seconds: float) -> bool:
    """Poll until no HTTP request is in progress (True) or `seconds` pass (False)."""
    end = time.monotonic() + seconds
    while state.in_progress > 0:
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(_POLL_S)
    return True


async def drain(state: ServerState, timeout_s: float) -> None:
    """Refuse new requests, wait for those in progress up to `timeout_s`, end the rest, stop the
    engine loop. Running streams end with their API's error event."""
    state.draining = True
    log.info("draining: %d requests in progress get up to %g s to finish (--drain-timeout); new requests "
             "get 503", state.in_progress, timeout_s)
    if not await _wait_idle(state, timeout_s):
        ended = state.loop.end_pending(f"the server is shutting down: the request was still running after "
                                       f"the {timeout_s:g} s drain period")
        log.warning("drain period of %g s over: ended %d requests still running", timeout_s, ended)
        await _wait_idle(state, _FLUSH_S)
    await asyncio.to_thread(state.loop.shutdown)
    log.info("drained; shutting down")


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM / SIGINT drains (`drain`) instead of closing the port."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state, self.drain_timeout_s = state, drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._signalled = False

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's handler, the signal is not re-raised at exit: a drained server exits 0.
        if self._signalled or self._loop is None:  # a second signal, or one before serving: stop now
            self.force_exit = self._signalled
            self.should_exit = True
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self.state, self.drain_timeout_s)
        finally:
            self.should_exit = True
