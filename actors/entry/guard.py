"""The entry's gate, in front of every route: API-key check and request-body size limit (ASGI middleware).

- API key: with a key configured (env `RINGSERVE_API_KEY`, never a flag), every route except `PUBLIC_PATHS`
  needs `Authorization: Bearer <key>`, compared in constant time; otherwise 401 with the OpenAI error body
  (`type: "authentication_error"`). The key is never logged or echoed.
- Body size: a declared `Content-Length` above the limit is refused with 413 before anything is read; a body
  without one (chunked) is counted while it is read and refused with 413 as soon as it passes the limit.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from actors.entry.errors import error_response
from bus.errors import ApiError

# Routes anyone may call: liveness for load balancers, metrics, and the API description (no secrets in it).
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


class BodyTooLarge(ApiError):
    """The request body passed the size limit while it was being read."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body exceeds the limit of {limit} bytes", 413)


def _unauthorized(message: str) -> ApiError:
    return ApiError(message, 401, type="authentication_error")


class EntryGuard:
    """ASGI middleware: Bearer auth (when `api_key` is set) and the `max_request_bytes` body limit."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int,
                 public_paths: frozenset[str] = PUBLIC_PATHS) -> None:
        self.app = app
        self._key = api_key.encode("utf-8") if api_key else None
        self.max_request_bytes = max_request_bytes
        self.public_paths = public_paths

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if self._key is None:
            return True
        # Starlette decodes header bytes as latin-1: encoding back gives the bytes the client sent
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if scope["path"] not in self.public_paths and not self._authorized(headers):
            error = _unauthorized("missing or invalid API key: send the header 'Authorization: Bearer <key>'")
            await error_response(error)(scope, receive, send)
            return
        declared = headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_request_bytes:
            await error_response(BodyTooLarge(self.max_request_bytes))(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_request_bytes:
                    raise BodyTooLarge(self.max_request_bytes)
            return message

        await self.app(scope, limited_receive, send)
