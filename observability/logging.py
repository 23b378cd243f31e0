"""Structured logging: one `key=value` line per event, tagged with the actor that wrote it."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any


class _KeyValueFormatter(logging.Formatter):
    def __init__(self, actor: str) -> None:
        super().__init__()
        self._actor = actor

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields: dict[str, Any] = getattr(record, "fields", {})
        extra = "".join(f" {k}={_quote(v)}" for k, v in fields.items())
        line = f"{stamp}.{int(record.msecs):03d} {record.levelname:<5} [{self._actor}] {record.getMessage()}{extra}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _quote(value: Any) -> str:
    text = str(value)
    return repr(text) if (" " in text or not text) else text


def setup_logging(actor: str, level: str | None = None) -> None:
    """Route the root logger to stderr in the key=value format, tagged `actor`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_KeyValueFormatter(actor))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("RINGSERVE_LOG_LEVEL", "INFO")).upper())
    for noisy in ("nats", "uvicorn.access", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def log_event(logger: logging.Logger, level: int, message: str, **fields: Any) -> None:
    """Log `message` with structured `fields` rendered as key=value pairs."""
    logger.log(level, message, extra={"fields": fields})
