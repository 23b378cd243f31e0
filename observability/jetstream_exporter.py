"""A SpanExporter that puts finished spans into a JetStream stream instead of sending them to a collector.

Each batch the BatchSpanProcessor hands over becomes one message: the OTLP/protobuf bytes of an
`ExportTraceServiceRequest`, exactly what a collector's `/v1/traces` takes. The processor calls `export` on
its own thread; the publish runs on the actor's asyncio loop (nats-py is not thread-safe) and `export` waits
for JetStream's ack, so a span counts as exported only once the stream has stored it. A retried publish
carries the same `Nats-Msg-Id`, so JetStream stores a batch once even when an ack was lost. The trace
exporter actor forwards the stream to the collector (actors/trace_exporter/).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import Any, Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger("tracing")
MSG_ID_HEADER = "Nats-Msg-Id"
HEADROOM = 512  # bytes of max_payload for the headers: the server counts them, nats-py does not


class JetStreamSpanExporter(SpanExporter):
    """Publishes span batches to `subject` (a JetStream stream's subject) through nats-py context `js`.

    Create it on the loop thread that owns the NATS connection (`loop`); `export` must not run on that thread.
    """

    def __init__(self, js: Any, loop: asyncio.AbstractEventLoop, subject: str, msg_id_prefix: str,
                 max_payload: int, timeout: float = 5.0, attempts: int = 5) -> None:
        self._js = js
        self._max_payload = max_payload - HEADROOM
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._subject = subject
        self._prefix = msg_id_prefix
        self._ids = itertools.count()
        self._timeout = timeout
        self._attempts = attempts
        self._shutdown = False
        self.exported_batches = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Store `spans` in the stream; SUCCESS once JetStream acked them."""
        if self._shutdown or not spans:
            return SpanExportResult.FAILURE if self._shutdown else SpanExportResult.SUCCESS
        if threading.get_ident() == self._loop_thread:
            log.error("spans exported on the event loop's own thread; dropped %d spans", len(spans))
            return SpanExportResult.FAILURE
        return self._export(list(spans), f"{self._prefix}-{next(self._ids)}")

    def _export(self, spans: list[ReadableSpan], msg_id: str) -> SpanExportResult:
        data = encode_spans(spans).SerializeToString()
        result = self._publish(data, msg_id)
        if result == "too large" and len(spans) > 1:  # halve the batch until each part fits max_payload
            half = len(spans) // 2
            first = self._export(spans[:half], msg_id + "a")
            second = self._export(spans[half:], msg_id + "b")
            ok = first == second == SpanExportResult.SUCCESS
            return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE
        if result != "ok":
            log.warning("could not store %d spans in JetStream: %s", len(spans), result)
            return SpanExportResult.FAILURE
        self.exported_batches += 1
        return SpanExportResult.SUCCESS

    def _publish(self, data: bytes, msg_id: str) -> str:
        """"ok", "too large", or why the last attempt failed; the same msg id on every attempt (dedupe)."""
        import nats.errors

        if len(data) > self._max_payload:
            return "too large"
        last = "not tried"
        for attempt in range(self._attempts):
            try:
                future = asyncio.run_coroutine_threadsafe(
                    self._js.publish(self._subject, data, timeout=self._timeout, headers={MSG_ID_HEADER: msg_id}),
                    self._loop)
                future.result(self._timeout + 1.0)
                return "ok"
            except nats.errors.MaxPayloadError:
                return "too large"
            except RuntimeError as exc:  # the event loop is closed: nothing more can be sent
                return repr(exc)
            except Exception as exc:  # a timeout or no responders (reconnecting, no stream yet): try again
                last = repr(exc)
                time.sleep(min(0.25 * 2 ** attempt, 2.0))
        return last

    def shutdown(self) -> None:
        """Refuse further batches (the processor flushed what it had before calling this)."""
        self._shutdown = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered here: every export waits for its ack."""
        return True
