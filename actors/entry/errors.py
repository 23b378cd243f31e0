"""HTTP answers for the ring's one error type, `ringserve.bus.errors.ApiError`: OpenAI's body, the status from its `code`."""

from __future__ import annotations

from starlette.responses import JSONResponse

from typing import Any

from ringserve.bus.errors import ApiError, quote


def error_response(error: ApiError) -> JSONResponse:
    """The error as a JSON response, with `Retry-After` when it says to retry and the Bearer challenge on 401."""
    headers = {}
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    if error.code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error.body(), status_code=error.code, headers=headers)


def model_not_found(model: Any, served_model: str) -> ApiError:
    """OpenAI's 404 for a model id this server does not serve."""
    return ApiError(f"the model {quote(model)} does not exist; this server serves {served_model!r}", 404,
                    "model", "model_not_found")


def server_busy(message: str) -> ApiError:
    """A 503 the client should retry shortly (`Retry-After: 1`)."""
    return ApiError(message, 503, type="server_error", retry_after=1)
