"""HTTP errors in the style of the API the client speaks: OpenAI everywhere, Anthropic on
/v1/messages. Every error names what was wrong (and, for bad fields, which field), and every one
sent is logged with its status, field and reason (INFO for 4xx, WARNING for 5xx).

    OpenAI      {"error": {"message", "type", "param", "code"}}   code: a string or null, never the status
    Anthropic   {"type": "error", "error": {"type", "message"}}

A prompt over the context has the wording the agents look for before they compact a conversation:
OpenAI's `context_length_exceeded` / "maximum context length", Anthropic's
"prompt is too long: N tokens > M maximum".
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

log = logging.getLogger("ferryman.server")

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 408: "invalid_request_error", 413: "invalid_request_error",
                 422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
                    422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
                    504: "timeout_error"}
# OpenAI's error codes where a status has one; other errors carry code null
_OPENAI_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded"}


class APIError(Exception):
    """An HTTP error. `message` is the OpenAI wording; `anthropic_message`, when set, replaces it
    on the Anthropic API; `code` is OpenAI's error code (a string) or None."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None,
                 anthropic_message: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}
        self.code = code if code is not None else _OPENAI_CODES.get(status)
        self.anthropic_message = anthropic_message

    def message_for(self, path: str) -> str:
        if is_anthropic_path(path) and self.anthropic_message is not None:
            return self.anthropic_message
        return self.message

    def body(self, path: str) -> dict[str, Any]:
        """The error object of the API at `path`."""
        message = self.message_for(path)
        if is_anthropic_path(path):
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": message}}
        kind = _OPENAI_TYPES.get(self.status, "server_error")
        return {"error": {"message": message, "type": kind, "param": self.param, "code": self.code}}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return APIError(status, message, param).body(path)


def log_error(path: str, err: APIError) -> None:
    """One line per error sent: status, route, field, reason."""
    field = f" [{err.param}]" if err.param else ""
    log.log(logging.WARNING if err.status >= 500 else logging.INFO, "%d on %s%s: %s", err.status, path, field,
            err.message_for(path))


def error_response(path: str, err: APIError) -> JSONResponse:
    log_error(path, err)
    return JSONResponse(err.body(path), status_code=err.status, headers=err.headers)


def context_overflow(prompt_len: int, max_model_len: int, param: str) -> APIError:
    """The prompt leaves no room for an output token (1 at least) in the context. The longest
    prompt allowed is max_model_len - 1, so Anthropic's "N tokens > M maximum" holds as written."""
    what = "messages" if param == "messages" else "prompt"
    room = "" if prompt_len > max_model_len else " (at least 1 token must be left for the output)"
    return APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
                         f"resulted in {prompt_len} tokens{room}. Please reduce the length of the {what}.",
                    param, code="context_length_exceeded",
                    anthropic_message=f"prompt is too long: {prompt_len} tokens > {max_model_len - 1} maximum")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_union_tag(part: str) -> bool:
    """pydantic puts the tried member of a union in the location: `str`, `list[TextPart]`, ..."""
    return part in _TYPE_TAGS or "[" in part or part[:1].isupper()


def field_path(loc: tuple[Any, ...], dotted: bool = False) -> str:
    """pydantic location ("body", "messages", 0, "role") -> "messages[0].role" (OpenAI's way) or,
    dotted, "messages.0.role" (Anthropic's)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int) and not dotted:
            out += f"[{part}]"
        elif isinstance(part, int) or not _is_union_tag(str(part)):
            out += ("." if out else "") + str(part)
    return out or "body"


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The first bad field of a request body as a 400 naming it. For a union (str or list of
    parts, ...) the deepest error under that field is the informative one."""
    if not errors:
        return APIError(400, "invalid request body")
    errs = [jsonable_encoder(e) for e in errors]
    if errs[0].get("type") == "json_invalid":
        detail = errs[0].get("ctx", {}).get("error", errs[0].get("msg"))
        return APIError(400, f"the request body is not valid JSON: {detail}", "body")
    first = field_path(tuple(errs[0].get("loc", ())))
    under = [(field_path(tuple(e.get("loc", ()))), e) for e in errs]
    param, e = max((pe for pe in under if pe[0].startswith(first)), key=lambda pe: len(pe[0]))
    msg = e.get("msg", "invalid value")
    anthropic = f"{field_path(tuple(e.get('loc', ())), dotted=True)}: {msg}"
    if e.get("type") == "missing":
        return APIError(400, f"missing required field '{param}'", param, code="missing_required_parameter",
                        anthropic_message=anthropic)
    return APIError(400, f"invalid field '{param}': {msg}", param, code="invalid_value", anthropic_message=anthropic)
