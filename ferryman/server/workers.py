"""Template rendering and tokenising off the event loop: a few threads, each with its own tokenizer.

A 100k-token prompt takes the tokenizer a second or more; on the event loop that second stalls
every other request, stream and /health probe. `PromptWorkers.run(fn, *args)` calls
`fn(tokenizer, *args)` in a worker thread, where `tokenizer` is that thread's private copy (a Rust
tokenizer shared by two threads can fail with "Already borrowed"). The Rust tokenizer releases the
GIL while it encodes; a template's Python runs between the event loop's turns (the GIL switches
every few milliseconds), under its own deadline (`template.deadline`).
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

WORKERS = 2  # prompts prepared at once; more wait their turn (tokenising is bounded by max_prompt_chars)


class PromptWorkers:
    def __init__(self, tokenizer: Any, workers: int = WORKERS) -> None:
        self._base = copy.deepcopy(tokenizer)  # never used directly: each thread copies it once
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ferryman-prompt")

    def _tokenizer(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None and self._base is not None:
            tok = self._local.tokenizer = copy.deepcopy(self._base)
        return tok

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(this thread's tokenizer, *args)` in a worker; its exception is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(self._tokenizer(), *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
