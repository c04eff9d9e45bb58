"""HTTP errors in the style of the API the client speaks: OpenAI everywhere, Anthropic on
/v1/messages. Every error names what was wrong (and, for bad fields, which field)."""

from __future__ import annotations

from typing import Any

from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 408: "invalid_request_error",
                 413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    408: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    if is_anthropic_path(path):
        kind = _ANTHROPIC_TYPES.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = _OPENAI_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(path: str, err: APIError) -> JSONResponse:
    return JSONResponse(error_body(path, err.status, err.message, err.param), status_code=err.status,
                        headers=err.headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_union_tag(part: str) -> bool:
    """pydantic puts the tried member of a union in the location: `str`, `list[TextPart]`, ..."""
    return part in _TYPE_TAGS or "[" in part or part[:1].isupper()


def field_path(loc: tuple[Any, ...]) -> str:
    """pydantic location ("body", "messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_union_tag(str(part)):
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
    if e.get("type") == "missing":
        return APIError(400, f"missing required field '{param}'", param)
    return APIError(400, f"invalid field '{param}': {e.get('msg', 'invalid value')}", param)
