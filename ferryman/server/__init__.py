"""OpenAI- and Anthropic-compatible HTTP server (`ferryman serve`)."""

from ferryman.server.app import build_app, serve
from ferryman.server.engine_loop import EngineLoop
from ferryman.server.state import ServerConfig

__all__ = ["EngineLoop", "ServerConfig", "build_app", "serve"]
