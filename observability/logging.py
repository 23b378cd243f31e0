"""Structured logging: one `key=value` line per event, tagged with the actor that wrote it.

Every line starts with a time stamp, a level and `[actor]`. Anything that can carry a client's text (a value, a
message's arguments, an exception's message, a native library's stderr) is escaped before it is written: line
breaks, other control characters and ANSI escapes become `\\n`, `\\x1b`, ..., and it is cut to a bounded
length, so nothing a client sends can start a line that reads like ours. An exception's traceback keeps its
own lines, each indented under its record. In actor processes, file descriptor 2 itself is captured
(`observability/native_stderr.py`): what C/C++ libraries and child processes write there comes out as our
lines too.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
import types
from typing import Any, TextIO

MAX_MESSAGE_CHARS = 2000
MAX_VALUE_CHARS = 1000
MAX_TRACEBACK_LINES = 200
TRACEBACK_INDENT = "  | "  # a traceback's lines start so; ours start with a time stamp
LAUNCHER = "launcher"  # shares its stderr with the actors it starts: its file descriptor 2 is not captured


def bounded(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, saying how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}…[+{len(text) - limit} chars]"


def escape(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` on one line: every character `str.isprintable` refuses but the space (line breaks, control
    characters, ESC, bidi overrides) written as its Python escape, then bounded to `limit` characters."""
    text = bounded(text, limit)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


def format_line(created: float, level: str, actor: str, message: str) -> str:
    """One log line as ours look: `22:40:00.000 ERROR [launcher] message` (`message` escaped here)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(created))
    millis = int((created - int(created)) * 1000)
    return f"{stamp}.{millis:03d} {level:<5} [{actor}] {escape(message.rstrip(chr(10)))}"


def format_traceback(exc: BaseException) -> str:
    """`exc`'s traceback (with its causes), every line indented by TRACEBACK_INDENT and the exceptions'
    messages escaped onto one line each: a message cannot add a line of its own."""
    lines: list[str] = []
    for part in _chain(traceback.TracebackException.from_exception(exc)):
        if isinstance(part, str):
            lines += ["", part, ""]
            continue
        if part.stack:
            lines.append("Traceback (most recent call last):")
            lines += "".join(part.stack.format()).splitlines()
        lines.append(escape("".join(part.format_exception_only()).rstrip("\n"), MAX_VALUE_CHARS))
    if len(lines) > MAX_TRACEBACK_LINES:
        cut = len(lines) - MAX_TRACEBACK_LINES
        lines = lines[:MAX_TRACEBACK_LINES // 2] + [f"... {cut} lines ..."] + lines[-MAX_TRACEBACK_LINES // 2:]
    return "\n".join(TRACEBACK_INDENT + escape(line, MAX_MESSAGE_CHARS) for line in lines)


def _chain(te: traceback.TracebackException) -> list[traceback.TracebackException | str]:
    """`te` and the exceptions it came from, oldest first, with the sentence Python puts between them."""
    parts: list[traceback.TracebackException | str] = []
    seen: set[int] = set()
    current: traceback.TracebackException | None = te
    while current is not None and id(current) not in seen and len(seen) < 10:
        seen.add(id(current))
        parts.insert(0, current)
        if current.__cause__ is not None:
            parts.insert(0, "The above exception was the direct cause of the following exception:")
            current = current.__cause__
        elif current.__context__ is not None and not current.__suppress_context__:
            parts.insert(0, "During handling of the above exception, another exception occurred:")
            current = current.__context__
        else:
            current = None
    return parts if not isinstance(parts[0], str) else parts[1:]


class _KeyValueFormatter(logging.Formatter):
    def __init__(self, actor: str) -> None:
        super().__init__()
        self._actor = actor

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {})
        extra = "".join(f" {escape(str(k), 100)}={_quote(v)}" for k, v in fields.items())
        line = format_line(record.created, record.levelname, self._actor, record.getMessage()) + extra
        if record.exc_info and record.exc_info[1] is not None:
            line += "\n" + format_traceback(record.exc_info[1])
        elif record.stack_info:
            line += "\n" + "\n".join(TRACEBACK_INDENT + escape(s) for s in record.stack_info.splitlines())
        return line


def _quote(value: Any) -> str:
    """A field's value: as it is when it is one plain word, else as a Python string literal (escaped)."""
    text = bounded(str(value), MAX_VALUE_CHARS)
    return text if (text and text.isprintable() and " " not in text) else repr(text)


def setup_logging(actor: str, level: str | None = None, capture_native: bool | None = None) -> None:
    """Route the root logger to stderr in the key=value format, tagged `actor`.

    `capture_native` (default: in every process but the launcher, whose stderr its actors share): also capture
    file descriptor 2, so that native libraries' and child processes' stderr comes out as escaped log lines
    (`observability/native_stderr.py`); Python's own `sys.stderr` then writes to the original stderr.
    Warnings and uncaught exceptions go through the logger too.
    """
    level = (level or os.environ.get("RINGSERVE_LOG_LEVEL", "INFO")).upper()
    stream: TextIO = sys.stderr
    if capture_native if capture_native is not None else actor != LAUNCHER:
        from ringserve.observability.native_stderr import capture_fd2

        stream = capture_fd2(actor, level) or stream
        sys.stderr = stream
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_KeyValueFormatter(actor))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("nats", "uvicorn.access", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: types.TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("uncaught").critical("uncaught exception", exc_info=(kind, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("uncaught").critical("uncaught exception in thread %s", name,
                                           exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def log_event(logger: logging.Logger, level: int, message: str, **fields: Any) -> None:
    """Log `message` with structured `fields` rendered as key=value pairs (escaped and bounded, as everything
    this module writes)."""
    logger.log(level, message, extra={"fields": fields})
