"""Every failure leaves the server in the OpenAI error shape.

`{"error": {"message", "type", "param", "code"}}` for our own errors, FastAPI's validation
errors (400, not 422), malformed JSON, unknown routes and unexpected exceptions (500).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("tandem.server")

# OpenAI reports client mistakes (auth and unknown models included) as invalid_request_error.
_TYPES = MappingProxyType({500: "server_error", 503: "server_error"})


class APIError(Exception):
    """An error a client can act on; `status` is the HTTP status it maps to."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, param=self.param, code=self.code)


def error_body(
    message: str, status: int, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: APIError, request: Request | None = None) -> JSONResponse:
    state = getattr(request.app.state, "tandem", None) if request is not None else None
    if state is not None:
        state.metrics.request_errors.labels(str(exc.status)).inc()
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _location(loc: Sequence[int | str]) -> str:
    # ("body", "messages", 0, "content") -> "messages[0].content"
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_message(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the first offending field."""
    if errors and errors[0].get("type") == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", "")
        return f"Malformed JSON body: {detail}".rstrip(": "), None
    parts = []
    for error in errors:
        where = _location(error.get("loc", ()))
        got = f" (got {error['input']!r})" if _short(error.get("input")) else ""
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden":
            message, got = "this field is not supported by this server", ""
        parts.append(f"{where}: {message}{got}" if where else message)
    param = _location(errors[0].get("loc", ())) if errors else None
    return "; ".join(parts) or "Invalid request", param or None


def _short(value: Any) -> bool:
    return isinstance(value, (int, float, str)) and len(repr(value)) <= 80


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return error_response(APIError(message, 400, param=param), request)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "HTTP error"
        if exc.status_code == 404:
            message = f"Unknown route {request.method} {request.url.path}"
        return error_response(APIError(message, exc.status_code, headers=exc.headers), request)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(
            APIError(f"Internal server error: {type(exc).__name__}", 500), request
        )
