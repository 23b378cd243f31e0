"""The entry's gate, in front of every route (ASGI middleware): Host check, API keys, body size and read time.

- Host: a request whose `Host` header names no allowed host gets 421, so a web page that rebinds its DNS name
  to this machine cannot reach the API from the operator's browser (`--allowed-hosts`; by default the
  loopback names when the entry listens on loopback, any host otherwise).
- API key: with a key configured (env `RINGSERVE_API_KEY`, never a flag), every route except `PUBLIC_PATHS`
  needs `Authorization: Bearer <key>` or Anthropic's `x-api-key: <key>`, compared in constant time; otherwise
  401 with the OpenAI error body (`type: "authentication_error"`; Anthropic's under `/v1/messages`). With
  `RINGSERVE_ADMIN_API_KEY` set, the operator routes (`ADMIN_PATHS`) need that key instead. Keys are never
  logged or echoed.
- Body size: a declared `Content-Length` above the limit is refused with 413 before anything is read; a body
  without one (chunked) is counted while it is read and refused with 413 as soon as it passes the limit.
- Read time: a body still incomplete `body_read_timeout` seconds after the request began gets 408.
"""

from __future__ import annotations

import asyncio
import hmac
import time

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ringserve.actors.entry.anthropic import errors as anthropic_errors
from ringserve.actors.entry.anthropic.request import MESSAGES_PATH
from ringserve.actors.entry.errors import error_response
from ringserve.actors.entry.settings import EntrySettings
from ringserve.bus.errors import ApiError

# Routes anyone may call: liveness for load balancers, metrics, and the API description (no secrets in it).
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})
# Routes that change the server's state for everyone: guarded by the admin key when one is set.
ADMIN_PATHS = frozenset({"/flush_cache", "/pause_generation", "/continue_generation", "/abort_request",
                         "/update_weights_from_disk", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class BodyTooLarge(ApiError):
    """The request body passed the size limit while it was being read."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body exceeds the limit of {limit} bytes", 413)


def _key_matches(headers: Headers, key: bytes) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    # Starlette decodes header bytes as latin-1: encoding back gives the bytes the client sent
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), key):
        return True
    x_api_key = headers.get("x-api-key")  # Anthropic's clients send the key so
    return x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode("latin-1"), key)


def host_name(host_header: str) -> str:
    """The host of a `Host` header, lowercased, without its port (`[::1]:8000` -> `::1`)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class EntryGuard:
    """ASGI middleware applying `settings`: allowed hosts, API keys, the body size limit and read time."""

    def __init__(self, app: ASGIApp, settings: EntrySettings) -> None:
        self.app = app
        self._key = settings.api_key.encode("utf-8") if settings.api_key else None
        self._admin_key = settings.admin_api_key.encode("utf-8") if settings.admin_api_key else None
        self._hosts = settings.resolved_allowed_hosts()
        self.max_request_bytes = settings.max_request_bytes
        self.body_read_timeout = settings.body_read_timeout

    def _refusal(self, scope: Scope, headers: Headers) -> ApiError | None:
        host = headers.get("host")
        if self._hosts is not None and host is not None and host_name(host) not in self._hosts:
            return ApiError(f"the Host {host[:100]!r} is not served here (see --allowed-hosts)", 421,
                            param="Host")
        path = scope["path"]
        if path in PUBLIC_PATHS:
            return None
        key = self._admin_key if path in ADMIN_PATHS and self._admin_key is not None else self._key
        if key is not None and not _key_matches(headers, key):
            which = "admin API key" if key is self._admin_key else "API key"
            return ApiError(f"missing or invalid {which}: send the header 'Authorization: Bearer <key>' (or "
                            "'x-api-key: <key>')", 401, type="authentication_error")
        declared = headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_request_bytes:
            return BodyTooLarge(self.max_request_bytes)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope, Headers(scope=scope))
        if refusal is not None:
            answer = (anthropic_errors.error_response if scope["path"].startswith(MESSAGES_PATH)
                      else error_response)
            await answer(refusal)(scope, receive, send)
            return
        received = 0
        deadline = time.monotonic() + self.body_read_timeout
        body_done = False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # after the body only a disconnect can come: no deadline on waiting for it
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise ApiError(f"the request body did not arrive within {self.body_read_timeout:g} s", 408) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_request_bytes:
                    raise BodyTooLarge(self.max_request_bytes)
                body_done = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)
