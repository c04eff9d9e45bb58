"""Offline Python API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ferryman.config import EngineConfig
from ferryman.engine.llm_engine import LLMEngine
from ferryman.engine.outputs import RequestOutput, StepDelta
from ferryman.errors import ConfigError, ModelLoadError
from ferryman.sampling_params import SamplingParams
from ferryman.tokenizer import apply_chat_template

DEMO_MODEL = Path(__file__).parent / "assets" / "demo-moe"


def default_model() -> str:
    if not (DEMO_MODEL / "config.json").exists():
        raise ModelLoadError(f"the bundled demo model is missing from {DEMO_MODEL}; pass a model folder")
    return str(DEMO_MODEL)


class LLM:
    """Load a model once, then generate.

    >>> llm = LLM("path/to/model", device="auto", dtype="auto")
    >>> outs = llm.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=32))
    """

    def __init__(self, model: str | None = None, device: str = "auto", dtype: str = "auto", **kwargs: Any) -> None:
        self.config = EngineConfig(model=model or default_model(), device=device, dtype=dtype, **kwargs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    # ---- prompts -----------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ConfigError("this model ships no tokenizer; pass prompt_token_ids instead of text")
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    def _prompt_ids(self, prompts: list[str] | str | None, prompt_token_ids: list[list[int]] | None) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ConfigError("pass exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is not None:
            return [list(p) for p in prompt_token_ids]
        return [self.encode(p) for p in ([prompts] if isinstance(prompts, str) else prompts)]

    # ---- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str] | str | None = None,
        params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        progress: bool | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in prompt order.

        progress: a bar over finished requests (default: the engine's `progress` setting)."""
        ids = self._prompt_ids(prompts, prompt_token_ids)
        if isinstance(params, SamplingParams) and params.logits_processors and len(ids) > 1:
            raise ConfigError("SamplingParams.logits_processors may keep state per sequence: pass one "
                              f"SamplingParams per prompt (a list of {len(ids)}), each with its own processors")
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(ids)
        if len(plist) != len(ids):
            raise ConfigError(f"got {len(plist)} SamplingParams for {len(ids)} prompts")
        rids = [self.engine.add_request(p, sp) for p, sp in zip(ids, plist)]
        show = self.config.progress if progress is None else progress
        with Progress(TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), disable=not show or len(rids) < 2, transient=True) as bar:
            task = bar.add_task("generate", total=len(rids))
            while any(r in self.engine.requests for r in rids):
                self.engine.step()
                bar.update(task, completed=sum(r not in self.engine.requests for r in rids))
        return [self.engine.pop_output(r) for r in rids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[StepDelta]:
        """Yield deltas of one request as tokens arrive; the last one has finish_reason set."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        rid = self.engine.add_request(ids, params or SamplingParams())
        try:
            while rid in self.engine.requests:
                for d in self.engine.step():
                    if d.request_id == rid:
                        yield d
        finally:
            if rid in self.engine.requests:
                self.engine.abort(rid)
            self.last_output = self.engine.pop_output(rid)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def memory_split(self) -> dict[str, Any]:
        """How the device region splits between KV pages and expert slots (LLMEngine.memory_split)."""
        return self.engine.memory_split()

    def set_memory_bounds(self, min_expert_slots: int | None = None, max_expert_slots: int | None = None,
                          kv_reserve_tokens: int | None = None) -> dict[str, Any]:
        """Change the split's bounds (LLMEngine.set_memory_bounds); returns the new split."""
        return self.engine.set_memory_bounds(min_expert_slots, max_expert_slots, kv_reserve_tokens)

    def score(self, prompt_token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Logits [L_i, V] (fp32) at every position of each prompt, computed as one batch."""
        return self.engine.score([list(p) for p in prompt_token_ids])
