"""Decode OTLP trace requests (`ExportTraceServiceRequest` protobuf bytes) into plain span records.

Used by `ringserve trace` (reading the JetStream buffer) and by the tests' OTLP receiver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

STATUS_NAMES = {0: "unset", 1: "ok", 2: "error"}
KIND_NAMES = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass
class SpanEvent:
    """A timestamped event inside a span."""

    name: str
    time_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class SpanRecord:
    """One finished span with its process's resource attributes."""

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # 16 hex digits, "" for a root span
    name: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: list[SpanEvent] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace_id, span_id) of linked spans
    status: str = "unset"
    status_message: str = ""

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", "?"))

    @property
    def process(self) -> tuple[str, Any]:
        """What tells processes apart: (service.instance.id, process.pid)."""
        return str(self.resource.get("service.instance.id", "")), self.resource.get("process.pid")

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def any_value(value: Any) -> Any:
    """The Python value of an OTLP AnyValue."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in pairs}


def decode_request(data: bytes) -> list[SpanRecord]:
    """Every span of one (or several concatenated) ExportTraceServiceRequest message(s)."""
    request = ExportTraceServiceRequest.FromString(data)
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(SpanRecord(
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                    name=s.name, kind=KIND_NAMES.get(s.kind, str(s.kind)), start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano, attributes=_attributes(s.attributes), resource=resource,
                    events=[SpanEvent(e.name, e.time_unix_nano, _attributes(e.attributes)) for e in s.events],
                    links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                    status=STATUS_NAMES.get(s.status.code, str(s.status.code)), status_message=s.status.message))
    return spans
