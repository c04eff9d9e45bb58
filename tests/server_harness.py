"""Live ferryman servers for the server tests: uvicorn in a background thread on a free port.

The tiny chat model is a random qwen3_moe built by transformers (vocab 8192) with the demo
model's tokenizer and ChatML template copied in, so every API path runs in milliseconds.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import uvicorn
from transformers import AutoConfig, AutoModelForCausalLM

from ferryman.config import EngineConfig
from ferryman.engine.llm_engine import LLMEngine
from ferryman.llm import DEMO_MODEL
from ferryman.server import EngineLoop, ServerConfig, build_app

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def build_tiny_chat_model(folder: Path, seed: int = 0, max_positions: int = 512,
                          heads: tuple[int, int] = (4, 2)) -> Path:
    """A tiny random qwen3_moe (fp32) that reads and writes the demo model's tokens; heads: (query,
    kv) attention heads (fewer: cheaper long prompts on the CPU, whose attention is most of their time)."""
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=8192, hidden_size=64, num_hidden_layers=2, num_attention_heads=heads[0],
        num_key_value_heads=heads[1], head_dim=16, max_position_embeddings=max_positions, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
        norm_topk_prob=True, rms_norm_eps=1e-6, eos_token_id=0, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # large output weights: peaked distributions, so greedy ties are unlikely
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "norm" not in name:
                p.normal_(0.0, (12.0 if "lm_head" in name else 2.0) / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    for f in TOKENIZER_FILES:
        shutil.copy(DEMO_MODEL / f, folder / f)
    return folder


class ScriptedLogits:
    """A logits processor that makes the model write `script` (then EOS): the real API paths with
    an output we choose (reasoning, tool calls, stop strings)."""

    def __init__(self, script: list[int], eos: int = 0) -> None:
        self.script, self.eos = script, eos

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))  # [V]
        n = len(output_token_ids)
        out[self.script[n] if n < len(self.script) else self.eos] = 0.0
        return out


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    loop: EngineLoop
    app: Any
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.loop.shutdown()
        self.app.state.ferryman.workers.close()


def start_server(model: str, cfg: ServerConfig | None = None, **engine_kwargs: Any) -> LiveServer:
    kwargs = dict(device="cpu", dtype="float32", max_num_seqs=32, max_num_batched_tokens=256)
    kwargs.update(engine_kwargs)
    engine = LLMEngine(EngineConfig(model=model, **kwargs))
    cfg = cfg or ServerConfig(served_model_names=["tiny"])
    loop = EngineLoop(engine, max_pending=cfg.max_pending, step_timeout_s=cfg.step_timeout_s)
    app = build_app(loop, cfg)
    loop.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start within 20 s")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", loop, app, server, thread)


@contextmanager
def serving(model: str, cfg: ServerConfig | None = None, script: str | None = None,
            **engine_kwargs: Any) -> Iterator[LiveServer]:
    """A live server for the span of a fixture; with `script`, every request writes that text."""
    srv = start_server(model, cfg, **engine_kwargs)
    try:
        if script is None:
            yield srv
        else:
            with scripted(srv, script):
                yield srv
    finally:
        srv.stop()


@contextmanager
def logits_processor(server: "LiveServer", proc: Any) -> Iterator[None]:
    """Requests submitted meanwhile sample through `proc` alone (it replaces their grammar)."""
    loop = server.loop
    submit = loop.submit
    loop.submit = lambda ids, params: submit(ids, dataclasses.replace(params, logits_processors=[proc]))
    try:
        yield
    finally:
        del loop.submit


def scripted(server: "LiveServer", text: str) -> Any:
    """The engine writes `text` (in the server's tokens) whatever the prompt."""
    tok = server.loop.engine.tokenizer
    return logits_processor(server, ScriptedLogits(tok.encode(text, add_special_tokens=False)))


def delay_steps(server: "LiveServer", delay_s: float) -> None:
    """From now on every engine step sleeps `delay_s` first (0: no more): keeps requests in flight
    for as long as a test needs."""
    engine = server.loop.engine
    engine.__dict__.pop("step", None)
    if delay_s > 0:
        step = engine.step

        def slow_step() -> Any:
            time.sleep(delay_s)
            return step()

        engine.step = slow_step


def wait_until(predicate: Any, timeout_s: float = 5.0, what: str = "condition") -> float:
    """Poll `predicate` until true; returns the seconds it took (fails the test after timeout_s)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - start
