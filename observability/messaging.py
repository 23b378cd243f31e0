"""NATS messaging spans after the OpenTelemetry messaging conventions (used by bus/connection.py when on).

A publish or request is a `send <template>` span (PRODUCER, or CLIENT for a request that waits for a reply),
whose context travels in the message's `traceparent` header; a delivery is a `process <template>` span
(CONSUMER), child of that context and active while the handler runs. Span names use the subject's template
(`out.{rid}`, `tokens.{shard}`), never the concrete per-request subject, which is an attribute instead.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from ringserve.observability import tracing
from ringserve.observability.traceparent import TRACEPARENT_HEADER

SYSTEM = "nats"


def _attributes(subject: str, template: str, operation_type: str, operation: str, size: int) -> dict[str, object]:
    return {"messaging.system": SYSTEM, "messaging.operation.type": operation_type,
            "messaging.operation.name": operation, "messaging.destination.name": subject,
            "messaging.destination.template": template, "messaging.message.body.size": size}


@contextlib.contextmanager
def send(subject: str, template: str, parent: str | None, size: int,
         request: bool = False) -> Iterator[dict[str, str]]:
    """A `send <template>` span around one publish (or request); yields the NATS headers carrying its context.

    Child of `parent` (a traceparent) or else of the active span. An exception marks it failed.
    """
    span = tracing.start_span(f"send {template}", parent, kind="client" if request else "producer",
                              attributes=_attributes(subject, template, "send", "request" if request else "publish",
                                                     size))
    try:
        yield {TRACEPARENT_HEADER: tracing.traceparent_of(span) or ""}
    except BaseException as exc:
        tracing.set_error(span, f"{type(exc).__name__}: {exc}", exc)
        raise
    finally:
        tracing.end_span(span)


@contextlib.contextmanager
def process(subject: str, template: str, sender: str | None, size: int, queue: str = "") -> Iterator[str]:
    """A `process <template>` span, child of the sender's traceparent and active inside the block.

    Yields the span's own traceparent (what the handler passes on to the messages it sends).
    """
    attributes = _attributes(subject, template, "process", "process", size)
    if queue:
        attributes["messaging.consumer.group.name"] = queue
    span = tracing.start_span(f"process {template}", sender, kind="consumer", attributes=attributes,
                              root=sender is None)
    try:
        with tracing.activated(span):
            yield tracing.traceparent_of(span) or ""
    except BaseException as exc:
        tracing.set_error(span, f"{type(exc).__name__}: {exc}", exc)
        raise
    finally:
        tracing.end_span(span)


def mark_failed(description: str, exc: BaseException | None = None) -> None:
    """Mark the active span (a `process` span inside a handler) failed."""
    if tracing.enabled():
        from opentelemetry import trace

        tracing.set_error(trace.get_current_span(), description, exc)
