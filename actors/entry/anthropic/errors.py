"""Errors in Anthropic's shape: the body, the HTTP response (with the headers of the other routes' errors) and
the `error` event of a stream that already began."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from ringserve.actors.entry.anthropic.answers import event
from ringserve.bus.errors import ApiError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def error_body(exc: ApiError) -> dict[str, Any]:
    """Anthropic's error body; a busy server's 503 (with Retry-After) is `overloaded_error`, other 5xx
    `api_error`. The message names the field where the error has one."""
    if exc.code == 503 and exc.retry_after is not None:
        kind = "overloaded_error"
    else:
        kind = ERROR_TYPES.get(exc.code, "api_error" if exc.code >= 500 else "invalid_request_error")
    message = exc.message
    if exc.param and not message.startswith(exc.param):
        message = f"{exc.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(exc: ApiError) -> JSONResponse:
    """The error as an HTTP response in Anthropic's shape, with the headers of the other routes' errors."""
    headers = {} if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
    if exc.code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body(exc), status_code=exc.code, headers=headers)


def error_event(exc: ApiError) -> str:
    """An error after the stream began, as Anthropic sends it: an `error` event."""
    return event("error", {"error": error_body(exc)["error"]})
