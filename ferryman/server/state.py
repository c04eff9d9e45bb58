"""What every route needs: the engine loop, tokenizer, chat renderer, grammars, parsers, limits."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferryman.errors import ConfigError
from ferryman.server.chat import ChatPrompt, ChatRenderer, RenderLimits, check_size, check_text
from ferryman.server.engine_loop import EngineLoop
from ferryman.server.errors import APIError, context_overflow
from ferryman.server.grammar import GrammarCompiler
from ferryman.server.harmony import HarmonyParser, harmony_marker_ids
from ferryman.server.parsers import OutputParser, PlainParser, Qwen3Parser
from ferryman.server.workers import PromptWorkers
from ferryman.tokenizer import TokenIdText

PARSERS = ("auto", "qwen3", "harmony", "none")
CHARS_PER_TOKEN = 32  # default max_prompt_chars = this x max_model_len: far above any real text


@dataclass
class ServerConfig:
    served_model_names: list[str] = field(default_factory=list)  # first one is shown by /v1/models
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer KEY` or `x-api-key`
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    max_pending: int = 256  # requests in flight (queued + running) before 429
    max_prompt_chars: int | None = None  # prompt text before tokenising (400 above); None: 32 x max_model_len
    body_timeout_s: float = 30.0  # a request body not received within this gets 408
    drain_timeout_s: float = 30.0  # on SIGTERM, running requests get this long to finish
    step_timeout_s: float = 600.0  # an engine step running longer kills the engine (watchdog)
    trust_request_chat_template: bool = False  # render chat templates sent with requests (sandboxed)
    template_timeout_s: float = 2.0  # one chat-template render
    output_parser: str = "auto"  # reasoning / tool-call parser: auto | qwen3 | harmony | none
    warm_up: bool = True  # CUDA: compile the first requests' kernels before serving (engine/warm_up.py)
    max_tokens_default: int | None = None  # budget of a request without max_tokens; None: all the context leaves
    max_stop_strings: int = 64  # more stop strings in one request get 400
    max_stop_bytes: int = 4096  # stop strings of one request, UTF-8 bytes together; more get 400

    def __post_init__(self) -> None:
        if self.output_parser not in PARSERS:
            raise ConfigError(f"output parser must be one of {', '.join(PARSERS)}, got {self.output_parser!r}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_pending < 1:
            raise ConfigError(f"max_pending must be >= 1, got {self.max_pending}")
        if self.max_tokens_default is not None and self.max_tokens_default < 1:
            raise ConfigError(f"max_tokens_default must be >= 1, got {self.max_tokens_default}")
        if self.max_stop_strings < 0 or self.max_stop_bytes < 0:
            raise ConfigError(f"max_stop_strings and max_stop_bytes must be >= 0, got {self.max_stop_strings}, "
                              f"{self.max_stop_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key is empty; give a non-empty key, or none to serve without one")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1024:
            raise ConfigError(f"max_prompt_chars must be >= 1024, got {self.max_prompt_chars}")
        for name in ("body_timeout_s", "step_timeout_s", "template_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.drain_timeout_s >= 0:
            raise ConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


class ServerState:
    def __init__(self, loop: EngineLoop, cfg: ServerConfig) -> None:
        self.loop = loop
        self.cfg = cfg
        engine = loop.engine
        # A private copy: the engine thread decodes with its own, and a Rust tokenizer shared by
        # two threads can fail ("Already borrowed") when one of them changes its settings.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.max_model_len = engine.max_model_len
        self.created = int(time.time())
        model = engine.ecfg.model  # /path/to/Qwen3-30B-A3B is served as Qwen3-30B-A3B
        names = cfg.served_model_names or [Path(model.rstrip("/")).name or model]
        self.model_names = list(dict.fromkeys(names))
        self._accepted = set(self.model_names) | {model}
        self.max_prompt_chars = cfg.max_prompt_chars or CHARS_PER_TOKEN * self.max_model_len
        limits = RenderLimits(self.max_prompt_chars, cfg.template_timeout_s, cfg.trust_request_chat_template)
        self.renderer = ChatRenderer(self.tokenizer, limits, message_ends=engine.uses_message_ends)
        self.workers = PromptWorkers(self.tokenizer)
        self.draining = False  # set on SIGTERM: new requests get 503 (lifecycle.py)
        self.in_progress = 0  # HTTP requests past the gate, not yet answered (streams until their end)
        self.vocab_size = engine.cfg.vocab_size
        eos = sorted(t for t in engine.eos_token_ids if 0 <= t < self.vocab_size)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, eos or None)
        self._harmony = harmony_marker_ids(self.tokenizer) if self.tokenizer is not None else None
        self.parser_kind = cfg.output_parser
        if self.parser_kind == "auto":
            gpt_oss = engine.cfg.model_type == "gpt_oss" and self._harmony is not None
            self.parser_kind = "none" if self.tokenizer is None else "harmony" if gpt_oss else "qwen3"
        if self.parser_kind == "harmony" and self._harmony is None:
            raise ConfigError("the harmony parser needs a tokenizer with the harmony special tokens")

    # ---- checks ------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        check_text(name, "model")
        if name not in self._accepted:
            raise APIError(404, f"model '{name}' does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.model_names)}", "model")

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty", param)
        if len(ids) >= self.max_model_len:
            raise context_overflow(len(ids), self.max_model_len, param)
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param)

    def check_room(self, count: int, param: str = "n") -> None:
        """A request of `count` engine requests (n x prompts) that could never fit the queue is a 400;
        one that fits later gets its 429 from the loop."""
        if count > self.loop.max_pending:
            raise APIError(400, f"the request needs {count} generations at once (n x prompts); this server "
                                f"takes at most {self.loop.max_pending} in flight (--max-queue)", param)

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """Output budget: what was asked (else the server's default), at most what the context
        leaves: a request asking for more is clamped, not refused."""
        room = self.max_model_len - prompt_len
        wanted = requested if requested is not None else self.cfg.max_tokens_default
        return room if wanted is None else min(wanted, room)

    def encode(self, text: str, param: str = "prompt", tokenizer: Any = None) -> list[int]:
        """Prompt text -> ids; a 400 on `param` for text no tokenizer takes (too long, not Unicode)."""
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        if tokenizer is None:
            raise APIError(400, "this model ships no tokenizer: send the prompt as token ids", param)
        check_size(len(text), self.max_prompt_chars, "the prompt", param)
        check_text(text, param)
        return list(tokenizer.encode(text, add_special_tokens=True))

    async def encode_prompt(self, text: str, param: str = "prompt") -> list[int]:
        """`encode` in a worker thread (the size check first, at once)."""
        check_size(len(text), self.max_prompt_chars, "the prompt", param)
        return await self.workers.run(lambda tok: self.encode(text, param, tok))

    async def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                          template_kwargs: dict[str, Any] | None = None,
                          client_template: str | None = None) -> ChatPrompt:
        """`renderer.render` in a worker thread: the template and the tokenizer never run on the event loop."""
        return await self.workers.run(lambda tok: self.renderer.render(messages, tools, template_kwargs,
                                                                       client_template, tok))

    # ---- output -------------------------------------------------------------------------------
    def make_parser(self, tools: bool, prompt: ChatPrompt) -> OutputParser:
        if self.parser_kind == "harmony":
            return HarmonyParser(self.tokenizer, self._harmony or {})
        if self.parser_kind == "qwen3":
            return Qwen3Parser(tools=tools, starts_in_reasoning=prompt.ends_in_reasoning)
        return PlainParser()

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"<{token_id}>"

    def decode(self, ids: list[int]) -> str:
        return (self.tokenizer or TokenIdText()).decode(ids, skip_special_tokens=True)
