"""Give the C heap's freed memory back to the system once a process has been idle a moment.

glibc's malloc keeps most of what a process frees for its next allocations: tensors below its mmap threshold
(which rises to 32 MiB as large blocks are freed) come from heaps that a free only shrinks from the top, one
per thread that allocates. The scheduler frees a step's activations every step, from its engine thread and the
threads the compiler and weight reads run on, so after mixed traffic its resident memory stays at the largest
steps' high-water mark and creeps up as the heaps fragment: measured with tests/api/test_soak.py's traffic on a
2-core EPYC (Zen 3), +100-140 MiB per 5-second round of traffic, all of it returned by one `malloc_trim(0)`
(after which the scheduler was within 8-38 MiB of where it started). To an operator that reads as a leak.

`HeapTrimmer` trims once per idle spell, `HEAP_TRIM_IDLE_SECONDS` after the last step (never between closely
spaced requests, which reuse the freed memory), on a thread of its own so that a request arriving meanwhile
does not wait for it (a trim that returns 600 MiB takes about 40 ms; the engine's allocations meanwhile wait
for the heap it is trimming). Where the C library has no `malloc_trim` (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Callable

from ringserve.observability.logging import log_event

log = logging.getLogger(__name__)

HEAP_TRIM_IDLE_SECONDS = 1.0  # idle this long after steps before the freed heap is given back


def libc_malloc_trim() -> Callable[[], bool] | None:
    """glibc's `malloc_trim(0)` as a callable (True when it released memory), None without one."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: bool(trim(0))


class HeapTrimmer:
    """Tracks whether work ran since the last trim and trims on request, in the background."""

    def __init__(self, trim: Callable[[], bool] | None = None) -> None:
        self._trim = trim if trim is not None else libc_malloc_trim()
        self._pending = False
        self._running = threading.Lock()

    @property
    def pending(self) -> bool:
        """Whether work ran since the last trim (and this C library can trim at all)."""
        return self._pending and self._trim is not None

    def note_work(self) -> None:
        """Work ran: the next idle spell trims."""
        self._pending = True

    def trim_in_background(self) -> None:
        """Start a trim on a thread of its own; nothing when one is running or no work ran since the last."""
        if not self.pending or not self._running.acquire(blocking=False):
            return
        self._pending = False
        threading.Thread(target=self._run, name="heap-trim", daemon=True).start()

    def _run(self) -> None:
        try:
            started = time.perf_counter()
            released = self._trim()  # type: ignore[misc]  # pending is False without one
            log_event(log, logging.DEBUG, "heap trimmed", released=released,
                      ms=round((time.perf_counter() - started) * 1e3, 1))
        finally:
            self._running.release()
