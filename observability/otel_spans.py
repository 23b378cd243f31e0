"""OpenTelemetry SDK setup and span helpers, imported only once tracing is on (see observability/tracing.py).

One TracerProvider per process, with a resource naming the process (`service.name`, `service.instance.id`,
`process.pid`) and a BatchSpanProcessor, so finished spans are exported from the processor's thread, never
from the event loop. Parents and links are given as W3C `traceparent` strings, the form the bus carries.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from typing import Any, Iterable, Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
KINDS = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT,
         "producer": SpanKind.PRODUCER, "consumer": SpanKind.CONSUMER}
DEFAULT_SCHEDULE_DELAY_MS = 1000  # unless OTEL_BSP_SCHEDULE_DELAY says otherwise


class Tracing:
    """The process's provider and tracer."""

    def __init__(self, service_name: str, attributes: Mapping[str, Any], exporter: SpanExporter) -> None:
        resource = Resource.create({"service.name": service_name, "service.instance.id": uuid.uuid4().hex,
                                    "process.pid": os.getpid(), **attributes})
        self.instance_id = str(resource.attributes["service.instance.id"])
        self.provider = TracerProvider(resource=resource)
        delay = None if os.environ.get("OTEL_BSP_SCHEDULE_DELAY") else DEFAULT_SCHEDULE_DELAY_MS
        self.processor = BatchSpanProcessor(exporter, **({"schedule_delay_millis": delay} if delay else {}))
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("ringserve")

    def shutdown(self) -> None:
        """Export every finished span and stop the processor's thread (blocking)."""
        self.provider.shutdown()


def span_context(traceparent: str | None) -> SpanContext | None:
    """The remote SpanContext a traceparent names, or None when it is missing or malformed."""
    match = _TRACEPARENT.match(traceparent or "")
    if match is None:
        return None
    trace_id, span_id = int(match.group(1), 16), int(match.group(2), 16)
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(match.group(3), 16)))


def parent_context(traceparent: str | None) -> otel_context.Context | None:
    """A context whose current span is the remote parent `traceparent`; None: use the active context."""
    ctx = span_context(traceparent)
    return None if ctx is None else trace.set_span_in_context(NonRecordingSpan(ctx))


def traceparent_of(span: Any) -> str:
    """The W3C traceparent of `span` (what a child in another process is parented to)."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def current_traceparent() -> str | None:
    """The traceparent of the active span, or None when there is none."""
    span = trace.get_current_span()
    return traceparent_of(span) if span.get_span_context().is_valid else None


def links(traceparents: Iterable[str], attributes: Mapping[str, Any] | None = None) -> list[Link]:
    """Span links to each valid traceparent (for spans that serve many requests, such as a scheduler step)."""
    out = []
    for tp in traceparents:
        ctx = span_context(tp)
        if ctx is not None:
            out.append(Link(ctx, dict(attributes or {})))
    return out


def start_span(tracing: Tracing, name: str, parent: str | None = None, kind: str = "internal",
               attributes: Mapping[str, Any] | None = None, link_to: Sequence[str] = (),
               start_ns: int | None = None, root: bool = False) -> Any:
    """Start (not activate) a span: child of `parent` (a traceparent), else of the active span, else a root.

    `root`: start a new trace even if a span is active (links then tie it to what it serves).
    """
    ctx = parent_context(parent)
    if ctx is None and root:
        ctx = otel_context.Context()
    return tracing.tracer.start_span(name, context=ctx, kind=KINDS[kind], attributes=dict(attributes or {}),
                                     links=links(link_to) if link_to else None, start_time=start_ns)


def set_error(span: Any, description: str, exc: BaseException | None = None) -> None:
    """Mark `span` failed (status ERROR with `description`), recording `exc` if given."""
    if exc is not None:
        span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, description))


def use_span(span: Any) -> Any:
    """Context manager activating `span` for the code inside it (does not end it)."""
    return trace.use_span(span, end_on_exit=False)


def now_ns() -> int:
    """Wall-clock nanoseconds, the time base of span timestamps."""
    return time.time_ns()
