"""The tracing facade every ringserve process uses: spans when tracing is on, nothing at all when it is off.

Off (the default), `enabled()` is False, every helper is a no-op returning None, and OpenTelemetry is never
imported; the bus still carries W3C `traceparent` headers (observability/traceparent.py). On, `install()`
sets up the SDK (observability/otel_spans.py) with the exporter the process chose: OTLP to a collector, or
the JetStream buffer (observability/jetstream_exporter.py). Parents and links are W3C traceparent strings.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Mapping, Sequence

from ringserve.observability.traceparent import child_traceparent

log = logging.getLogger("tracing")
_state: Any = None  # otel_spans.Tracing while tracing is on


def enabled() -> bool:
    """Whether this process records spans."""
    return _state is not None


def install(service_name: str, exporter: Any, attributes: Mapping[str, Any] | None = None) -> str:
    """Turn tracing on for this process, exporting finished spans with `exporter` (an SDK SpanExporter).

    Returns the process's `service.instance.id`.
    """
    global _state
    from ringserve.observability import otel_spans

    if _state is not None:
        raise RuntimeError("tracing is already installed in this process")
    _state = otel_spans.Tracing(service_name, attributes or {}, exporter)
    return _state.instance_id


def shutdown() -> None:
    """Export every finished span and turn tracing off (blocking: call it off the event loop)."""
    global _state
    state, _state = _state, None
    if state is not None:
        try:
            state.shutdown()
        except Exception:  # the exporter logs its own failures; shutting down goes on
            log.exception("flushing spans failed")


def start_span(name: str, parent: str | None = None, kind: str = "internal",
               attributes: Mapping[str, Any] | None = None, link_to: Sequence[str] = (),
               start_ns: int | None = None, root: bool = False) -> Any:
    """A started span (end it with `end_span`), or None when tracing is off.

    Child of `parent` (a traceparent) if given, else of the active span, else (or with `root`) a new trace.
    """
    if _state is None:
        return None
    from ringserve.observability import otel_spans

    return otel_spans.start_span(_state, name, parent, kind, attributes, link_to, start_ns, root)


def end_span(span: Any, end_ns: int | None = None, error: str | None = None,
             exc: BaseException | None = None) -> None:
    """End `span` (None is ignored); `error` marks it failed with that description."""
    if span is None:
        return
    if error is not None:
        set_error(span, error, exc)
    span.end(end_time=end_ns)


def set_error(span: Any, description: str, exc: BaseException | None = None) -> None:
    """Mark `span` (None is ignored) failed without ending it."""
    if span is not None:
        from ringserve.observability import otel_spans

        otel_spans.set_error(span, description, exc)


def traceparent_of(span: Any) -> str | None:
    """The traceparent of `span`, or None for None."""
    if span is None:
        return None
    from ringserve.observability import otel_spans

    return otel_spans.traceparent_of(span)


def current_traceparent(fallback: str | None = None) -> str:
    """The active span's traceparent when tracing is on and a span is active; else, as with tracing off, a
    child of `fallback` (a client's traceparent header) or a fresh trace."""
    if _state is not None:
        from ringserve.observability import otel_spans

        current = otel_spans.current_traceparent()
        if current is not None:
            return current
    return child_traceparent(fallback)


@contextlib.contextmanager
def span(name: str, parent: str | None = None, kind: str = "internal",
         attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """Run the block inside a new active span (None when tracing is off); an exception marks it failed."""
    if _state is None:
        yield None
        return
    from ringserve.observability import otel_spans

    started = otel_spans.start_span(_state, name, parent, kind, attributes)
    try:
        with otel_spans.use_span(started):
            yield started
    finally:
        started.end()


@contextlib.contextmanager
def activated(span_: Any) -> Iterator[None]:
    """Make `span_` the active span inside the block (nothing for None)."""
    if span_ is None:
        yield
        return
    from ringserve.observability import otel_spans

    with otel_spans.use_span(span_):
        yield


def now_ns() -> int:
    """Wall-clock nanoseconds, the time base of span timestamps."""
    import time

    return time.time_ns()
