"""Helpers every route shares: SSE lines, JSON bodies, turning errors into HTTP responses, our version."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ringserve.actors.entry.errors import error_response
from ringserve.bus.errors import ApiError, server_error
from ringserve.actors.entry.json_input import check_content_type, parse_json_object
from ringserve.actors.entry.request_flow import ClientDisconnected
from ringserve.observability.logging import log_event

CLIENT_CLOSED_REQUEST = 499
log = logging.getLogger("entry")


@functools.cache
def package_version() -> str:
    """ringserve's installed version (SGLang's `version` in /get_server_info); 0.0.0 when not installed."""
    try:
        return importlib.metadata.version("ringserve")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def sse(data: Any) -> str:
    """One server-sent event line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object the ring can carry, or ApiError 415/413/400 saying why not."""
    check_content_type(request.headers.get("content-type"))
    return parse_json_object(await request.body())


async def read_command(request: Request) -> dict[str, Any]:
    """The body of a route that changes the server's state: JSON by its Content-Type, which a browser cannot
    send cross-origin without a CORS preflight (so a web page cannot forge it); an empty body is `{}`."""
    check_content_type(request.headers.get("content-type"), required=True)
    body = await request.body()
    return parse_json_object(body) if body.strip() else {}


def handles_errors(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Turn ApiError into its OpenAI error response and a vanished client into status 499.

    Anything else is a bug: logged with its traceback, answered 500 in the OpenAI shape without details.
    """
    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ApiError as exc:
            return error_response(exc)
        except (ClientDisconnected, ClientDisconnect):
            log_event(log, logging.INFO, "client went away", method=request.method, path=request.url.path)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            return error_response(server_error("internal server error"))

    return wrapped
