"""`ferryman serve`: its flags, the API key's sources, and the server's start."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferryman.cli_bench import HelpFormatter, port
from ferryman.envs import envs
from ferryman.errors import ConfigError


def add_serve(sub: argparse._SubParsersAction, model_help: str,
              engine_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    """`ferryman serve`'s parser; `engine_flags` adds the engine's flags, shared with `run`."""
    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server",
                           description="Serve MODEL over HTTP: /v1/chat/completions, /v1/responses, /v1/completions, "
                                       "/v1/models, /v1/messages, /health, /metrics, /v1/stats. SIGTERM drains: new "
                                       "requests get 503, running ones get --drain-timeout to finish, then the "
                                       "process exits 0. docs/server.md describes the limits.",
                           formatter_class=HelpFormatter)
    serve.add_argument("model", nargs="?", metavar="MODEL", help=model_help)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind; 127.0.0.1 is this machine only")
    serve.add_argument("--port", type=port, default=8000, help="port to bind")
    serve.add_argument("--api-key", help="require this key (Authorization: Bearer KEY or x-api-key) on /v1/* and "
                                         "/metrics; visible in `ps`, so prefer --api-key-file (docs/server.md) "
                                         "(default: none)")
    serve.add_argument("--served-model-name", action="append",
                       help="name clients use for the model (repeatable; default: the folder name)")
    serve.add_argument("--max-queue", type=int, default=256,
                       help="generations in flight (queued + running) before 429; a request needing more "
                            "(n x prompts) is a 400")
    serve.add_argument("--max-body-mb", type=float, default=8.0, help="larger request bodies get 413")
    serve.add_argument("--output-parser", default="auto", choices=["auto", "qwen3", "harmony", "none"],
                       help="reasoning / tool-call parser (auto: harmony for gpt-oss, else qwen3)")
    serve.add_argument("--max-tokens-default", type=int, default=None,
                       help="output tokens of a request that sets no max_tokens (default: all the context leaves; "
                            "/v1/completions: 16); any request is clamped to what the context leaves")
    serve.add_argument("--max-stop-strings", type=int, default=64, help="stop strings one request may send")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="the HTTP server's log level")
    serve.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                       help="serve at once, without first running requests that compile the GPU kernels (the "
                            "first users then wait for the compiles; default: warm up on a GPU)")
    serve_guard_flags(serve.add_argument_group("access and limits"))
    engine_flags(serve)


def serve_guard_flags(g: argparse._ArgumentGroup) -> None:
    """The API key file and the limits that keep one client from stalling or breaking the server."""
    g.add_argument("--api-key-file", metavar="PATH",
                   help="read the API key from this file (its first line; default: none)")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request body not received within this gets 408")
    g.add_argument("--max-prompt-chars", type=int, metavar="N",
                   help="prompt text (messages or prompt) above this many characters gets 400 before it is "
                        "tokenised (default: 32 x max_model_len)")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long running requests get to finish before they are ended")
    g.add_argument("--step-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="an engine step running longer is taken as hung: the engine is marked dead, requests "
                        "fail, /health turns 503")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept chat templates sent with requests (chat_template, chat_template_kwargs."
                        "chat_template), rendered sandboxed with time and size limits (default: refused with 400)")
    g.add_argument("--template-timeout", type=float, default=2.0, metavar="SECONDS",
                   help="time limit of one chat-template render")


def api_key(a: argparse.Namespace) -> str | None:
    """The server's key: --api-key, --api-key-file or FERRYMAN_API_KEY (one of them); None for none.
    An empty key is an error, never "no key"."""
    given = [name for name, v in (("--api-key", a.api_key), ("--api-key-file", a.api_key_file),
                                  ("FERRYMAN_API_KEY", envs.API_KEY or None)) if v is not None]
    if len(given) > 1:
        raise ConfigError(f"the API key is given twice ({' and '.join(given)}); give it once")
    if a.api_key_file is not None:
        try:
            lines = Path(a.api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--api-key-file {a.api_key_file}: cannot read it ({e})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ConfigError(f"--api-key-file {a.api_key_file}: the file is empty (its first line is the key)")
        return key
    if a.api_key is not None and not a.api_key.strip():
        raise ConfigError("--api-key is empty; give a key, or leave the flag out to serve without one")
    return a.api_key if a.api_key is not None else (envs.API_KEY or None)


def cmd_serve(a: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Serve with the engine built from `engine_kwargs` (the `run` flags' mapping)."""
    from ferryman.server import ServerConfig, serve

    cfg = ServerConfig(served_model_names=a.served_model_name or [], api_key=api_key(a),
                       max_body_bytes=int(a.max_body_mb * 2**20), max_pending=a.max_queue,
                       output_parser=a.output_parser, warm_up=a.warm_up, max_prompt_chars=a.max_prompt_chars,
                       body_timeout_s=a.body_timeout, drain_timeout_s=a.drain_timeout,
                       step_timeout_s=a.step_timeout, trust_request_chat_template=a.trust_request_chat_template,
                       template_timeout_s=a.template_timeout,
                       max_tokens_default=a.max_tokens_default, max_stop_strings=a.max_stop_strings)
    serve(engine_kwargs, a.model, cfg, host=a.host, port=a.port, log_level=a.log_level)
    return 0
