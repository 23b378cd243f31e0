"""Observability: structured logging, W3C trace context and OpenTelemetry tracing. Imports nothing else of
ringserve; OpenTelemetry itself is imported only once tracing is turned on (observability/tracing.py)."""
