"""Nothing the scheduler starts outlives it: its compile subprocesses end with it, however it ends.

The scheduler starts subprocesses while it runs: Inductor's `g++` (and the `cc1plus`, `as` and `ld` that `g++`
runs) for each decode graph it compiles (actors/engine/runner/graphs/graph_compiler.py), and `ninja` with its compilers when
the CPU kernels are JIT-built (kernels/cpu/__init__.py). A scheduler stopped mid-compile left them running,
parented to pid 1. `PR_SET_PDEATHSIG` cannot fix that: it reaches only a direct child (not `cc1plus`, nor the
compilers `ninja` runs), and Inductor spawns them itself.

What does: the scheduler leads a process group of its own (the launcher starts every actor in a session of its
own, a worker started from a shell leads its job's group; otherwise it makes one), so everything it spawns is
in that group, and `guard_process_group` starts a tiny guardian process in the group that holds the read end of
a pipe only the scheduler can write to. When the scheduler ends, by any means (exit, SIGTERM, SIGKILL, the
launcher's fail-stop), the kernel closes its end, and the guardian sends the whole group SIGTERM, then SIGKILL
GRACE_SECONDS later (itself included). SIGTERM first because `ninja` puts each compiler in a group of its own
and kills those groups only when it is told to stop; `g++` deletes its temporary files on SIGTERM. The
guardian ignores SIGINT, SIGTERM and SIGHUP, so a Ctrl-C of a worker's terminal does not take it first.

Not guarded: a scheduler running as pid 1 (a container's init: the kernel ends the whole pid namespace with it,
and group 1 would mean every process), or one in a terminal's foreground group it does not lead (moving it out
would take Ctrl-C away from it; the terminal's signals reach its compilers too).
"""

from __future__ import annotations

import os
import subprocess
import sys

GRACE_SECONDS = 0.5  # between the guardian's SIGTERM and SIGKILL to the group
_guardian: subprocess.Popen[bytes] | None = None  # kept: collecting it would close the pipe and fire the guardian

# Runs in the guardian (`python -I -S -c`): wait for EOF on stdin (the scheduler's end of the pipe), then end
# the group. argv[1]: the group id; argv[2]: GRACE_SECONDS.
_GUARDIAN = """# ringserve: ends the scheduler's process group once the scheduler is gone
import os, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
while sys.stdin.buffer.read(65536):
    pass
group = int(sys.argv[1])
for sig, wait in ((signal.SIGTERM, float(sys.argv[2])), (signal.SIGKILL, 0.0)):
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        break
    time.sleep(wait)
"""


def _in_foreign_foreground() -> bool:
    """Whether this process sits in a terminal's foreground process group that it does not lead."""
    for fd in (0, 1, 2):
        try:
            return os.tcgetpgrp(fd) == os.getpgrp() != os.getpid()
        except OSError:  # not a terminal
            continue
    return False


def lead_process_group() -> bool:
    """Make this process the leader of a process group of its own where it is not one already; whether it leads
    one now (False: pid 1, or a terminal's foreground job it must stay in; see the module docstring)."""
    pid = os.getpid()
    if pid == 1:
        return False
    if os.getpgrp() == pid:
        return True
    if _in_foreign_foreground():
        return False
    try:
        os.setpgid(0, 0)
    except OSError:  # a session leader cannot move (but then it leads its group already)
        return os.getpgrp() == pid
    return True


def guard_process_group() -> subprocess.Popen[bytes] | None:
    """Lead a process group and start its guardian, which ends every process of the group once this process has
    ended; the guardian's Popen (None where the group cannot be guarded). Call it before starting subprocesses.
    The pipe's write end stays open in this process only (close-on-exec, and subprocess closes other fds)."""
    global _guardian
    if _guardian is not None:
        return _guardian
    if not lead_process_group():
        return None
    argv = [sys.executable, "-I", "-S", "-c", _GUARDIAN, str(os.getpgrp()), str(GRACE_SECONDS)]
    _guardian = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, close_fds=True)
    return _guardian
