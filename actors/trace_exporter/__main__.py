"""`python -m ringserve.actors.trace_exporter`: run the trace exporter (started by the launcher with `--trace-buffer
jetstream`); it forwards to the collector that `--otlp-endpoint` / `OTEL_EXPORTER_OTLP_*` name."""

from __future__ import annotations

import argparse

from ringserve.actors.common.runtime import add_bus_arguments, run_actor
from ringserve.bus.span_stream import DEFAULT_MAX_AGE_S, DEFAULT_MAX_BYTES


def main() -> None:
    """Parse flags and run the trace exporter until stopped."""
    parser = argparse.ArgumentParser(prog="ringserve-trace-exporter", description="ringserve trace exporter actor")
    add_bus_arguments(parser)
    parser.add_argument("--span-max-age", type=float, default=DEFAULT_MAX_AGE_S,
                        help="seconds the span stream keeps a span (also after it was forwarded)")
    parser.add_argument("--span-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                        help="bytes the span stream keeps at most (the oldest spans go first)")
    parser.add_argument("--max-backoff", type=float, default=5.0,
                        help="longest wait in seconds between tries while the collector is unreachable")
    args = parser.parse_args()
    from ringserve.actors.trace_exporter.actor import trace_exporter_main

    run_actor("trace_exporter", args, lambda ctx: trace_exporter_main(ctx, args))


if __name__ == "__main__":
    main()
