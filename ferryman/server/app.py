"""The FastAPI app: routes, error handlers, API key, body limits, health, metrics; and `serve()`.

    ferryman serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key-file PATH]

/health answers 503 once the engine loop is dead or the server drains; /metrics is Prometheus
text; /v1/stats JSON. The API key (when set) guards /v1/* and /metrics; /health stays open for
probes. Before any route runs, `GateMiddleware` gives each request an id (`x-request-id`), refuses
it while draining (503), without the key (401), with a body over the limit (413) or one that is
not all received within `body_timeout_s` (408). Every 4xx / 5xx is logged on one line: request
id, method, path, status, reason and field.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ferryman.server.admin_api import router as admin_router
from ferryman.server.anthropic_api import router as anthropic_router
from ferryman.server.engine_loop import EngineLoop, on_a_passing_thread
from ferryman.server.errors import APIError, error_response, validation_error
from ferryman.server.metrics import ServerMetrics
from ferryman.server.openai_api import router as openai_router
from ferryman.server.responses_api import router as responses_router
from ferryman.server.state import ServerConfig, ServerState

log = logging.getLogger("ferryman.server")

_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/messages",
           "/v1/messages/count_tokens", "/v1/stats", "/v1/admin/memory", "/health", "/metrics"}
_DRAIN_OPEN = ("/health", "/metrics")  # still answered while draining, for probes and scrapers
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # a client's x-request-id is kept when it looks like one


def _authorized(headers: dict[bytes, bytes], key: str) -> bool:
    bearer = headers.get(b"authorization", b"")
    given = bearer[7:].strip() if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
    # digests of equal length: the comparison takes the same time whatever the key and its length
    return hmac.compare_digest(hashlib.sha256(given).digest(), hashlib.sha256(key.encode()).digest())


def _request_id(headers: dict[bytes, bytes]) -> str:
    given = headers.get(b"x-request-id", b"").decode("latin-1")
    return given if _REQUEST_ID.fullmatch(given) else "req_" + uuid.uuid4().hex[:16]


def log_error(scope: Scope, err: APIError) -> None:
    """One line per refused request: id, method, path, status, reason, field."""
    rid = scope.get("state", {}).get("request_id", "-")
    field = f" (field '{err.param}')" if err.param else ""
    level = logging.WARNING if err.status >= 500 else logging.INFO
    message = err.message.encode("utf-8", "backslashreplace").decode("utf-8")  # a client's lone surrogate
    log.log(level, "%s %s %s -> %d: %s%s", rid, scope.get("method", "-"), scope.get("path", "-"), err.status,
            message, field)


class GateMiddleware:
    """Request id, draining, API key, body limits (size and time), per-route status counting and
    the count of requests in progress, before any route runs."""

    def __init__(self, app: ASGIApp, cfg: ServerConfig, metrics: ServerMetrics, state: ServerState) -> None:
        self.app, self.cfg, self.metrics, self.state = app, cfg, metrics, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(scope["headers"])
        rid = _request_id(headers)
        scope.setdefault("state", {})["request_id"] = rid
        send = self._counting(send, path if path in _ROUTES else "other", rid)
        err = self._refusal(path, headers)
        if err is not None:
            log_error(scope, err)
            await error_response(path, err)(scope, _empty_receive, send)
            return
        if path in _DRAIN_OPEN:  # probes: not work a drain waits for
            await self.app(scope, self._limited(receive), send)
            return
        self.state.in_progress += 1
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            self.state.in_progress -= 1

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        if self.state.draining and path not in _DRAIN_OPEN:
            return APIError(503, "the server is shutting down and takes no new requests", headers={"Retry-After": "5"})
        key = self.cfg.api_key
        if key and (path.startswith("/v1/") or path == "/metrics") and not _authorized(headers, key):
            return APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.cfg.max_body_bytes:
            return _too_large(int(length), self.cfg.max_body_bytes)
        return None

    def _limited(self, receive: Receive) -> Receive:
        """The body: at most max_body_bytes (also without Content-Length), all of it within
        body_timeout_s of the request's start; after the body, messages pass as they come."""
        limit, timeout = self.cfg.max_body_bytes, self.cfg.body_timeout_s
        end = time.monotonic() + timeout
        received, done = 0, False

        async def limited() -> Message:
            nonlocal received, done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(end - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body was not received within {timeout:g} s "
                                         "(body_timeout)") from None
            done = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked body without Content-Length
                    raise HTTPException(413, _too_large(received, limit).message)
            return message

        return limited

    def _counting(self, send: Send, route: str, rid: str) -> Send:
        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(route, message["status"])
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        return counting


async def _empty_receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body is {size} bytes or more; the limit is {limit} bytes")


def _answer(request: Request, err: APIError) -> JSONResponse:
    log_error(request.scope, err)
    return error_response(request.url.path, err)


def _install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(request, validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        path = request.url.path
        message = str(exc.detail) if exc.status_code != 404 else f"no route {request.method} {path}"
        return _answer(request, APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(UnicodeError)
    async def bad_text(request: Request, exc: UnicodeError) -> JSONResponse:  # a check missed a surrogate
        return _answer(request, APIError(400, f"the request holds text that is not valid Unicode: {exc}"))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _answer(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


def build_app(loop: EngineLoop, cfg: ServerConfig | None = None) -> FastAPI:
    """The app around a started (or to be started) engine loop."""
    cfg = cfg or ServerConfig()
    metrics = ServerMetrics()
    metrics.attach(loop)
    state = ServerState(loop, cfg)
    app = FastAPI(title="ferryman", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ferryman = state
    app.add_middleware(GateMiddleware, cfg=cfg, metrics=metrics, state=state)
    _install_handlers(app)
    app.include_router(openai_router)
    app.include_router(anthropic_router)
    app.include_router(responses_router)
    app.include_router(admin_router)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not loop.alive and not state.draining:
            return JSONResponse({"status": "dead", "reason": loop.dead_reason or "engine thread not running"},
                                status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining", "requests_in_progress": state.in_progress}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in state.model_names:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves "
                                f"{', '.join(repr(n) for n in state.model_names)}", "model")
        return {"id": model_id, "object": "model", "created": state.created, "owned_by": "ferryman",
                "max_model_len": state.max_model_len}

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
    """Load the model, start the engine loop and serve until a signal has drained it (lifecycle.py)."""
    import uvicorn

    from ferryman.server.lifecycle import DrainingServer

    from ferryman.config import EngineConfig
    from ferryman.engine.llm_engine import LLMEngine
    from ferryman.llm import default_model

    def load() -> LLMEngine:
        engine = LLMEngine(EngineConfig(model=model or default_model(), **engine_kwargs))
        if cfg.warm_up and engine.device.type == "cuda":  # on a CPU nothing compiles at first use
            from ferryman.engine.warm_up import warm_up

            report = warm_up(engine)
            log.info("warmed up in %.1f s (%d steps of %d to %d sequences, the slowest %.2f s)", report.seconds,
                     report.steps, min(report.batch_sizes), max(report.batch_sizes), report.slowest_s)
        return engine

    engine = on_a_passing_thread(load)
    loop = EngineLoop(engine, max_pending=cfg.max_pending, step_timeout_s=cfg.step_timeout_s)
    app = build_app(loop, cfg)
    loop.start()
    state: ServerState = app.state.ferryman
    log.info("serving %s on http://%s:%d (max_model_len %d)%s", ", ".join(state.model_names), host, port,
             engine.max_model_len, ", API key required" if cfg.api_key else "")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    try:
        DrainingServer(config, state, cfg.drain_timeout_s).run()
    finally:
        loop.shutdown()
        state.workers.close()
