"""One test file at a time may load the host's CPUs on purpose (`@pytest.mark.host_load`, e.g. CPU hog
processes beside a ring): while it runs, the other xdist worker waits between its tests, and it waits for the
other worker's test in flight to end.

Without this, a busy-host test's hogs starve whatever the other worker runs beside it (a ring's heartbeats, a
grammar compile, a fuzz test's 600 requests) and that test fails for a load it never asked for. Every test holds
the host lock shared; a `host_load` test holds it exclusive. A second lock file, taken exclusive by a waiting
`host_load` test, keeps new shared holders out until it has run, so it is not starved between the other
worker's tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCKS_ENV = "RINGSERVE_TEST_LOCKS"


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def host_share(lock_dir: str, *, exclusive: bool) -> Iterator[None]:
    """Hold the host for one test: alone when `exclusive`, beside other shared holders otherwise."""
    gate, host = Path(lock_dir, "gate"), Path(lock_dir, "host")
    if exclusive:
        with _flock(gate, fcntl.LOCK_EX), _flock(host, fcntl.LOCK_EX):
            yield
        return
    with contextlib.ExitStack() as held:
        with _flock(gate, fcntl.LOCK_SH):  # waits while a host_load test waits or runs
            held.enter_context(_flock(host, fcntl.LOCK_SH))
        yield
