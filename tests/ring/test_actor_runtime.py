"""The actor runtime's exit when the process that started an actor dies (actors/common/runtime.py): the
actor stops at once and, if its stop hangs, exits hard `ORPHAN_EXIT_SECONDS` after its death signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ringserve.actors.common.runtime import ORPHAN_EXIT_SECONDS
from ringserve.bus.embedded_server import EmbeddedNatsServer
from tests.server_helpers import process_alive, wait_for
from tests.stuck_actor import HANG_SECONDS

ROOT = Path(__file__).resolve().parents[2]
# A parent that starts the actor with the launcher's death signal (SIGTERM when the parent dies), prints its pid
# and waits.
PARENT = """
import subprocess, sys, time
from ringserve.bus.embedded_server import die_with_parent
log = open(sys.argv[2], "wb")
child = subprocess.Popen([sys.executable, "-m", "tests.stuck_actor", "--nats-url", sys.argv[1]],
                         stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_an_orphaned_actor_whose_stop_hangs_exits_hard_soon_after_its_parent_dies(
        nats_server: EmbeddedNatsServer, tmp_path: Path) -> None:
    log = tmp_path / "actor.log"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, nats_server.url, str(log)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    actor = int(parent.stdout.readline())  # type: ignore[union-attr]
    try:
        wait_for(lambda: any(word in log.read_text(errors="replace") for word in ("ready", "crashed")), 60)
        assert " ready " in log.read_text(errors="replace"), log.read_text(errors="replace")
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        killed = time.monotonic()
        assert wait_for(lambda: not process_alive(actor), HANG_SECONDS / 2), "the orphan's hung stop kept it alive"
        took = time.monotonic() - killed
        text = log.read_text(errors="replace")
        assert "orphaned=True" in text, text
        assert ORPHAN_EXIT_SECONDS - 0.5 <= took <= ORPHAN_EXIT_SECONDS + 10, f"exited {took:.1f} s after its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if process_alive(actor):
            os.kill(actor, signal.SIGKILL)
