"""Tracing in an actor process: on as its flags and `OTEL_*` variables say (observability/tracing_config.py),
exporting over OTLP or into the JetStream span buffer, and flushed before the bus connection closes.

Each process is its own OpenTelemetry resource: `service.name` `ringserve-<role>`, a fresh
`service.instance.id`, `process.pid`, and `ringserve.role` / `ringserve.rank` / `ringserve.namespace`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from typing import Any

from ringserve.bus.connection import BusConnection
from ringserve.bus.subjects import Subjects
from ringserve.observability import tracing
from ringserve.observability.logging import log_event
from ringserve.observability.tracing_config import TracingConfig, config_from_args

log = logging.getLogger("actor")
UNTRACED_ROLES = ("trace_exporter",)  # it forwards spans; tracing it would feed its own input


def span_exporter(config: TracingConfig, bus: BusConnection, subjects: Subjects, role: str, rank: int) -> Any:
    """The SpanExporter `config` asks for: the JetStream buffer, OTLP/HTTP, OTLP/gRPC, or the console."""
    if config.buffer == "jetstream":
        from ringserve.observability.jetstream_exporter import JetStreamSpanExporter

        return JetStreamSpanExporter(bus.client.jetstream(), asyncio.get_running_loop(), subjects.spans(role),
                                     msg_id_prefix=f"{role}{rank}-{uuid.uuid4().hex}", max_payload=bus.max_payload)
    if config.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if config.protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError as exc:
            raise RuntimeError("--otlp-protocol grpc needs the grpc extra: pip install 'ringserve[grpc]'") from exc
        return GrpcExporter(endpoint=config.traces_url)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.traces_url)


async def start_tracing(args: argparse.Namespace, role: str, rank: int, bus: BusConnection,
                        subjects: Subjects) -> bool:
    """Turn tracing on for this actor if its configuration asks for it; whether it did."""
    config = config_from_args(args)
    if not config.enabled or role in UNTRACED_ROLES:
        return False
    exporter = span_exporter(config, bus, subjects, role, rank)
    instance = tracing.install(f"ringserve-{role}", exporter, {"ringserve.role": role, "ringserve.rank": rank,
                                                               "ringserve.namespace": subjects.namespace})
    where = subjects.span_stream() if config.buffer == "jetstream" else config.traces_url
    log_event(log, logging.INFO, "tracing on", exporter=config.buffer if config.buffer != "none" else config.exporter,
              to=where, instance=instance)
    return True


async def stop_tracing() -> None:
    """Export every span still buffered (off the event loop, which the JetStream exporter needs) and stop."""
    if tracing.enabled():
        await asyncio.to_thread(tracing.shutdown)
