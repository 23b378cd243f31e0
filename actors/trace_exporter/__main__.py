"""`python -m ringserve.actors.trace_exporter`: run the trace exporter (started by the launcher with `--trace-buffer
jetstream`); it forwards to the collector that `--otlp-endpoint` / `OTEL_EXPORTER_OTLP_*` name."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ringserve.actors.common.actor_flags import add_bus_arguments
from ringserve.actors.common.flag_fields import add_arguments, flag
from ringserve.actors.common.help_format import TRACING, DefaultOnceFormatter
from ringserve.actors.common.runtime import run_actor
from ringserve.bus.span_stream import DEFAULT_MAX_AGE_S, DEFAULT_MAX_BYTES


@dataclass
class SpanStreamFlags:
    """How long the span stream keeps spans, and how the exporter waits out a collector outage."""

    span_max_age: float = field(default=DEFAULT_MAX_AGE_S, metadata=flag(
        "seconds the span stream keeps a span (also after it was forwarded)", group=TRACING))
    span_max_bytes: int = field(default=DEFAULT_MAX_BYTES, metadata=flag(
        "bytes the span stream keeps at most (the oldest spans go first)", group=TRACING))
    max_backoff: float = field(default=5.0, metadata=flag(
        "longest wait in seconds between tries while the collector is unreachable", group=TRACING))


def build_parser(prog: str = "ringserve-trace-exporter") -> argparse.ArgumentParser:
    """The trace exporter's flags."""
    parser = argparse.ArgumentParser(prog=prog, description="ringserve trace exporter actor",
                                     formatter_class=DefaultOnceFormatter)
    add_bus_arguments(parser)
    add_arguments(SpanStreamFlags, parser)
    return parser


def main() -> None:
    """Parse flags and run the trace exporter until stopped."""
    args = build_parser().parse_args()
    from ringserve.actors.trace_exporter.actor import trace_exporter_main

    run_actor("trace_exporter", args, lambda ctx: trace_exporter_main(ctx, args))


if __name__ == "__main__":
    main()
