"""Native stderr as log lines: file descriptor 2 of an actor process becomes a pipe, read by a small helper
process that writes each line it receives as one of our log lines, escaped and bounded, marked
`native stderr:` (`python -m ringserve.observability.native_stderr_relay ACTOR LEVEL PARENT_PID`).

What writes to descriptor 2 directly (C/C++ libraries such as xgrammar or torch, and child processes such as
g++ that inherit it) would otherwise reach the log raw, and a client's text inside a native warning could start
a line that reads like ours. Python's own `sys.stderr` and the log handler write to a copy of the original
stderr instead, so a crash's traceback never waits on the pipe.

The reader is a process, not a thread: a native write into a full pipe blocks the writer, and a writer holding
the GIL would then starve a reader thread of the same process forever. The helper exits when the pipe closes
(every writer is gone) or, having read what is left, when the actor process dies (its parent-death signal),
so a grandchild that inherited the pipe cannot keep it alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from typing import Callable, TextIO

MARKER = "native stderr:"
MAX_LINE_BYTES = 8192  # of one native line; the rest of a longer line is counted, not kept
_captured: TextIO | None = None  # this process's stream on its original stderr, once fd 2 is captured


def capture_fd2(actor: str, level: str) -> TextIO | None:
    """Point file descriptor 2 at a pipe whose lines the helper process logs as `actor`'s; return a text
    stream on the original stderr (for `sys.stderr` and the log handler). None when fd 2 cannot be captured
    (it is closed, or no helper could start): the process then logs as before. Idempotent."""
    global _captured
    if _captured is not None:
        return _captured
    try:
        original = os.dup(2)
    except OSError:
        return None
    read_end, write_end = os.pipe()
    try:
        subprocess.Popen([sys.executable, "-m", "ringserve.observability.native_stderr_relay", actor, level,
                          str(os.getpid())], stdin=read_end, stdout=original, stderr=original, close_fds=True,
                         start_new_session=True)  # a kill of the actor's process group leaves it to drain
    except OSError:
        for fd in (read_end, write_end, original):
            os.close(fd)
        return None
    os.close(read_end)
    sys.stderr.flush()
    os.dup2(write_end, 2)  # descriptor 2 stays inheritable: child processes write into the pipe too
    os.close(write_end)
    _captured = open(original, "w", buffering=1, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
    import faulthandler

    if faulthandler.is_enabled():  # its fatal-error traceback goes straight to the original stderr
        faulthandler.enable(_captured, all_threads=True)
    return _captured


class LineSplitter:
    """Bytes in, whole lines out (decoded, at most MAX_LINE_BYTES of each kept; the count of the rest noted)."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self._emit = emit
        self._pending = bytearray()
        self._dropped = 0  # bytes of the current line beyond MAX_LINE_BYTES

    def feed(self, chunk: bytes) -> None:
        """Take `chunk`; emit every line it completes."""
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._take(chunk[start:end])
            self._flush_line()
            start = end + 1
        self._take(chunk[start:])

    def close(self) -> None:
        """Emit a last line that had no newline."""
        if self._pending or self._dropped:
            self._flush_line()

    def _take(self, piece: bytes) -> None:
        room = MAX_LINE_BYTES - len(self._pending)
        self._pending += piece[:room]
        self._dropped += max(0, len(piece) - room)

    def _flush_line(self) -> None:
        text = self._pending.decode("utf-8", "backslashreplace").rstrip("\r")
        if self._dropped:
            text += f"…[+{self._dropped} bytes]"
        self._pending.clear()
        self._dropped = 0
        self._emit(text)


class _ParentGone(Exception):
    """The actor process died: read what is left in the pipe, then stop."""


def _set_parent_death_signal() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def pump(fd: int, emit: Callable[[str], None], parent: int) -> None:
    """Read `fd` to its end, emitting each line; stop early (after reading what is buffered) once `parent`
    has died."""
    splitter = LineSplitter(emit)
    reading = False

    def on_term(signum: int, frame: object) -> None:
        if reading:
            raise _ParentGone
        os.set_blocking(fd, False)  # between reads: the loop drains and then finds the pipe empty

    signal.signal(signal.SIGTERM, on_term)
    _set_parent_death_signal()
    if os.getppid() != parent:  # it died before the signal was armed
        os.set_blocking(fd, False)
    try:
        while True:
            reading = True
            try:
                chunk = os.read(fd, 65536)
            finally:
                reading = False
            if not chunk:
                break
            splitter.feed(chunk)
    except (_ParentGone, BlockingIOError):
        os.set_blocking(fd, False)
        with contextlib.suppress(BlockingIOError, OSError):
            while chunk := os.read(fd, 65536):
                splitter.feed(chunk)
    splitter.close()
