"""The server's engine loop gathers requests that arrive together at an idle engine into its first
step (with offloaded experts, each prefill step streams every uncached expert once)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ferryman import LLM, SamplingParams
from ferryman.server import EngineLoop
from tiny_models import build_tiny


async def _submit_together(loop: EngineLoop, prompts: list[list[int]], gap_s: float) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    handles = []
    for p in prompts:
        handles.append(loop.submit(p, params))
        await asyncio.sleep(gap_s)  # arrivals a millisecond apart, as concurrent HTTP clients'

    async def tokens(h) -> list[int]:  # noqa: ANN001
        return [t async for ev in h.events() for t in ev.token_ids]

    return list(await asyncio.gather(*(tokens(h) for h in handles)))


def test_requests_arriving_together_share_the_first_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests 1 ms apart: all in the first step (without the window the first step holds
    only the first: it starts as soon as that one is in). The gap the loop waits for is widened
    to 50 ms here, so a loaded 2-core machine's late wake-ups do not split the arrivals."""
    import ferryman.server.engine_loop as el

    monkeypatch.setattr(el, "_GATHER_GAP_S", 0.05)
    monkeypatch.setattr(el, "_GATHER_WINDOW_S", 0.3)
    build_tiny("qwen3_moe", tmp_path)
    engine = LLM(str(tmp_path), device="cpu", dtype="float32", enforce_eager=True).engine
    sizes: list[int] = []
    step = engine.step

    def recorded():  # noqa: ANN202
        deltas = step()
        sizes.append(engine.last_step_size)
        return deltas

    monkeypatch.setattr(engine, "step", recorded)
    loop = EngineLoop(engine)
    loop.start()
    try:
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
        outs = asyncio.run(_submit_together(loop, prompts, 0.001))
    finally:
        loop.shutdown()
    assert all(len(o) == 3 for o in outs)
    assert sizes[0] == 4, sizes


def test_the_server_loads_on_a_thread_that_ends() -> None:
    """on_a_passing_thread: fn runs on another thread, which has ended when its result (or its
    exception, re-raised here) comes back, so no OpenMP team stays behind for it (engine_loop.py)."""
    import threading

    from ferryman.server.engine_loop import on_a_passing_thread

    seen: list[threading.Thread] = []

    def load() -> int:
        seen.append(threading.current_thread())
        return 7

    assert on_a_passing_thread(load) == 7
    assert seen[0] is not threading.main_thread() and not seen[0].is_alive()

    def fail() -> int:
        raise ValueError("bad checkpoint")

    with pytest.raises(ValueError, match="bad checkpoint"):
        on_a_passing_thread(fail)
