"""The entry's part of a request's trace: the root HTTP server span and the `stream to client` spans.

`traced_app` wraps the ASGI app (only when tracing is on) so every HTTP request is a SERVER span, child of the
client's `traceparent` header when it sends a valid one; the span is active while the request is served, so
the bus messages it causes (`send req.submit`, ...) are its children, and it ends when the response body is
complete (after the last streamed byte). EntryService calls three hooks (no-ops when tracing is off):
`admitted` puts the rid and the sampling parameters on the root, `started` records TTFT and opens one
`stream to client` span per choice, `released` closes it and adds usage, finish reasons and errors.
"""

from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from ringserve.bus.messages import GenerateRequest
from ringserve.bus.ring_client import RequestStream
from ringserve.observability import tracing
from ringserve.observability.traceparent import TRACEPARENT_HEADER, is_valid_traceparent

UNTRACED_PATHS = ("/health", "/metrics")  # polled by probes and scrapers: a trace each would be noise
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


@dataclass
class _Root:
    span: Any
    start_ns: int
    streams: dict[RequestStream, Any] = field(default_factory=dict)  # stream -> its `stream to client` span
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    spec_drafted: int = 0  # speculative decoding: draft tokens verified over the request's choices, and accepted
    spec_accepted: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    generation: bool = False
    first_output: bool = False


_current: contextvars.ContextVar[_Root | None] = contextvars.ContextVar("ringserve_http_root", default=None)
_by_stream: "weakref.WeakKeyDictionary[RequestStream, _Root]" = weakref.WeakKeyDictionary()


def traced_app(app: ASGIApp) -> ASGIApp:
    """`app` with a root SERVER span per HTTP request when tracing is on; `app` itself when it is off."""
    if not tracing.enabled():
        return app

    async def traced(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED_PATHS:
            await app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope.get("headers", ())
                       if k.decode("latin-1").lower() == TRACEPARENT_HEADER), None)
        method, path = scope["method"], scope["path"]
        span = tracing.start_span(f"{method} {path}", header if is_valid_traceparent(header) else None, kind="server",
                                  root=True, attributes={"http.request.method": method, "url.path": path,
                                                         "http.route": path, "url.scheme": scope.get("scheme", "http")})
        root = _Root(span, tracing.now_ns())
        token = _current.set(root)
        status: list[int] = []

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            with tracing.activated(span):
                await app(scope, receive, send_status)
        except BaseException as exc:
            tracing.set_error(span, f"{type(exc).__name__}: {exc}", exc)
            raise
        finally:
            _current.reset(token)
            _finish_root(root, status[0] if status else None)

    return traced


def _finish_root(root: _Root, status: int | None) -> None:
    span = root.span
    if status is not None:
        span.set_attribute("http.response.status_code", status)
        if status == 404:
            span.update_name(span.name.split(" ")[0])  # unknown path: keep the span name low-cardinality
        if status >= 500:
            tracing.set_error(span, f"HTTP {status}")
    now = tracing.now_ns()
    if root.generation:
        span.set_attribute("gen_ai.server.request.duration", (now - root.start_ns) / 1e9)
    for stream in list(root.streams):  # a stream never released (should not happen): close its span
        released(stream)
    tracing.end_span(span, now)


def admitted(streams: list[RequestStream], gen_reqs: list[GenerateRequest]) -> None:
    """The requests of one HTTP request were admitted: name them and their sampling on the root span."""
    root = _current.get() if tracing.enabled() else None
    if root is None or not gen_reqs:
        return
    root.generation = True
    span = root.span
    rids = [g.rid for g in gen_reqs]
    span.set_attribute("ringserve.rid", rids[0])
    if len(rids) > 1:
        span.set_attribute("ringserve.rids", rids)
    sampling = gen_reqs[0].sampling
    span.set_attribute("gen_ai.operation.name", "chat" if gen_reqs[0].messages is not None else "text_completion")
    for key, name in (("max_new_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        value = sampling.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            span.set_attribute(f"gen_ai.request.{name}", value)
    lora_name = sampling.get("lora_name")
    if isinstance(lora_name, str):
        span.set_attribute("ringserve.lora_name", lora_name)  # the LoRA adapter that served it
    for stream in streams:
        _by_stream[stream] = root


def started(streams: list[RequestStream]) -> None:
    """The first output of each stream arrived: time to first token, and `stream to client` spans open."""
    if not tracing.enabled():
        return
    now = tracing.now_ns()
    for stream in streams:
        root = _by_stream.get(stream)
        if root is None or stream in root.streams:
            continue
        if not root.first_output:
            root.first_output = True
            root.span.set_attribute("gen_ai.server.time_to_first_token", (now - root.start_ns) / 1e9)
        root.streams[stream] = tracing.start_span("stream to client", tracing.traceparent_of(root.span),
                                                  start_ns=now, attributes={"ringserve.rid": stream.rid})


def released(stream: RequestStream) -> None:
    """The stream ended (finished, failed or aborted): close its span and add its usage to the root."""
    root = _by_stream.pop(stream, None) if tracing.enabled() else None
    if root is None:
        return
    span = root.streams.pop(stream, None)
    terminal = stream.terminal
    error = None
    if terminal is None:
        error = "aborted before the end (client gone or shut down)"
        root.finish_reasons.append("abort")
    elif terminal.error is not None:
        error = terminal.error.message
        root.finish_reasons.append("error")
    else:
        root.finish_reasons.append(terminal.finish.type if terminal.finish else "stop")
        if terminal.finish is not None and terminal.finish.type == "abort":
            error = "aborted"
    if terminal is not None:
        root.input_tokens = max(root.input_tokens, terminal.prompt_tokens)
        root.output_tokens += terminal.completion_tokens
        root.cached_tokens = max(root.cached_tokens, terminal.cached_tokens)
        root.spec_drafted += terminal.spec_drafted_tokens
        root.spec_accepted += terminal.spec_accepted_tokens
    root.span.set_attribute("gen_ai.usage.input_tokens", root.input_tokens)
    root.span.set_attribute("gen_ai.usage.output_tokens", root.output_tokens)
    root.span.set_attribute("gen_ai.usage.cache_read.input_tokens", root.cached_tokens)
    if root.spec_drafted:
        root.span.set_attribute("ringserve.speculative.drafted_tokens", root.spec_drafted)
        root.span.set_attribute("ringserve.speculative.accepted_tokens", root.spec_accepted)
    root.span.set_attribute("gen_ai.response.finish_reasons", list(root.finish_reasons))
    if error is not None:
        tracing.set_error(root.span, error)
    if span is not None:
        if terminal is not None:
            span.set_attribute("gen_ai.usage.output_tokens", terminal.completion_tokens)
        tracing.end_span(span, error=error)
