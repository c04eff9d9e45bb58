"""The FastAPI app: routes, error handlers, API key, body limit, health, metrics; and `serve()`.

    ferryman serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key KEY]

/health answers 503 once the engine loop is dead; /metrics is Prometheus text; /v1/stats JSON.
The API key (when set) guards /v1/*; /health and /metrics stay open for probes and scrapers.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ferryman.server.anthropic_api import router as anthropic_router
from ferryman.server.engine_loop import EngineLoop
from ferryman.server.errors import APIError, error_response, validation_error
from ferryman.server.metrics import ServerMetrics
from ferryman.server.openai_api import router as openai_router
from ferryman.server.responses_api import router as responses_router
from ferryman.server.state import ServerConfig, ServerState

log = logging.getLogger("ferryman.server")

_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/messages",
           "/v1/messages/count_tokens", "/v1/stats", "/health", "/metrics"}


def _authorized(headers: dict[bytes, bytes], key: str) -> bool:
    bearer = headers.get(b"authorization", b"").decode("latin-1")
    given = bearer[7:].strip() if bearer[:7].lower() == "bearer " else headers.get(b"x-api-key", b"").decode("latin-1")
    return hmac.compare_digest(given.encode(), key.encode())


class GateMiddleware:
    """API key, body-size limit and per-route status counting, before any route runs."""

    def __init__(self, app: ASGIApp, cfg: ServerConfig, metrics: ServerMetrics) -> None:
        self.app, self.cfg, self.metrics = app, cfg, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in _ROUTES else "other"
        headers = dict(scope["headers"])
        if self.cfg.api_key and path.startswith("/v1/") and not _authorized(headers, self.cfg.api_key):
            await self._reject(scope, send, route, APIError(401, "missing or wrong API key (send "
                                                            "'Authorization: Bearer KEY' or 'x-api-key: KEY')"))
            return
        limit = self.cfg.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._reject(scope, send, route, _too_large(int(length), limit))
            return
        await self.app(scope, self._limited(receive, limit), self._counting(send, route))

    @staticmethod
    def _limited(receive: Receive, limit: int) -> Receive:
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked body without Content-Length
                    raise HTTPException(413, _too_large(received, limit).message)
            return message

        return limited

    def _counting(self, send: Send, route: str) -> Send:
        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(route, message["status"])
            await send(message)

        return counting

    async def _reject(self, scope: Scope, send: Send, route: str, err: APIError) -> None:
        self.metrics.count_request(route, err.status)
        await error_response(scope["path"], err)(scope, _empty_receive, send)


async def _empty_receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body is {size} bytes or more; the limit is {limit} bytes")


def _install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        path = request.url.path
        message = str(exc.detail) if exc.status_code != 404 else f"no route {request.method} {path}"
        return error_response(path, APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request.url.path, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


def build_app(loop: EngineLoop, cfg: ServerConfig | None = None) -> FastAPI:
    """The app around a started (or to be started) engine loop."""
    cfg = cfg or ServerConfig()
    metrics = ServerMetrics()
    metrics.attach(loop)
    state = ServerState(loop, cfg)
    app = FastAPI(title="ferryman", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ferryman = state
    app.add_middleware(GateMiddleware, cfg=cfg, metrics=metrics)
    _install_handlers(app)
    app.include_router(openai_router)
    app.include_router(anthropic_router)
    app.include_router(responses_router)

    @app.get("/health")
    async def health() -> JSONResponse:
        if loop.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "dead", "reason": loop.dead_reason or "engine thread not running"},
                            status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return {"alive": loop.alive, "dead_reason": loop.dead_reason, "requests_in_flight": loop.num_pending,
                **loop.stats_snapshot, **metrics.totals(), "memory_bytes": metrics.memory}

    return app


def serve(engine_kwargs: dict[str, Any], model: str | None, cfg: ServerConfig, host: str = "127.0.0.1",
          port: int = 8000, log_level: str = "info") -> None:
    """Load the model, start the engine loop and run uvicorn until interrupted."""
    import uvicorn

    from ferryman.config import EngineConfig
    from ferryman.engine.llm_engine import LLMEngine
    from ferryman.llm import default_model

    engine = LLMEngine(EngineConfig(model=model or default_model(), **engine_kwargs))
    if cfg.warm_up and engine.device.type == "cuda":  # on a CPU nothing compiles at first use
        from ferryman.engine.warm_up import warm_up

        report = warm_up(engine)
        log.info("warmed up in %.1f s (%d steps of %d to %d sequences, the slowest %.2f s)", report.seconds,
                 report.steps, min(report.batch_sizes), max(report.batch_sizes), report.slowest_s)
    loop = EngineLoop(engine, max_pending=cfg.max_pending)
    app = build_app(loop, cfg)
    loop.start()
    names = ", ".join(app.state.ferryman.model_names)
    log.info("serving %s on http://%s:%d (max_model_len %d)", names, host, port, engine.max_model_len)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        loop.shutdown()
