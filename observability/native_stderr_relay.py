"""The helper process behind a captured stderr (observability/native_stderr.py): it reads what the actor's native
libraries and children write to file descriptor 2 from its stdin and logs each line as the actor's, at WARNING.

    python -m ringserve.observability.native_stderr_relay ACTOR LEVEL PARENT_PID
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from ringserve.observability.logging import setup_logging
from ringserve.observability.native_stderr import MARKER, pump


def main(argv: list[str]) -> None:
    """The helper: log every line of stdin as actor `argv[0]`'s at WARNING (silenced above WARNING)."""
    actor, level, parent = argv[0], argv[1], int(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the actors; this drains after
    setup_logging(actor, level, capture_native=False)
    log = logging.getLogger("native")
    pump(0, lambda line: log.warning("%s %s", MARKER, line), parent)
    logging.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)
