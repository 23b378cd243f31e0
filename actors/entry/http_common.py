"""Helpers every route shares: SSE lines, JSON bodies, and turning errors into HTTP responses."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from actors.entry.errors import ApiError
from actors.entry.request_flow import ClientDisconnected

CLIENT_CLOSED_REQUEST = 499


def sse(data: Any) -> str:
    """One server-sent event line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or ApiError 400 saying why not."""
    body = await request.body()
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError("the request body must be a JSON object")
    return data


def handles_errors(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Turn ApiError into its OpenAI error response and a vanished client into status 499."""
    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ApiError as exc:
            return exc.response()
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    return wrapped
