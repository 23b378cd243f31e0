"""The trace exporter actor: forwards the JetStream span buffer to an OTLP collector."""
