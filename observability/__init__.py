"""Observability: structured logging and W3C trace context. Imports nothing else of ringserve."""
