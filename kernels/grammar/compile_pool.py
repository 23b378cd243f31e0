"""The parent's side of the grammar compile workers (`ringserve.kernels.grammar.compile_worker`): up to `size` child
processes, each capped in memory, each request bounded in CPU time.

A worker is started lazily (the first one eagerly by the compiler, the rest when compiles come together, or by
`fill`) and kept for the next request. Its cold start is mostly importing torch and xgrammar (seconds of CPU),
which needs no tokenizer: `prestart` starts one worker process at once, before the tokenizer is loaded (an
actor calls it first thing, so the import overlaps the actor's own start and its model load), and the next
pool to start a worker in this process adopts it and sends it the setup. A request that had to start a worker
says so in one log line (`WORKER_WAIT_NOTE`), so a cold first compile is never silent. A
request whose worker spends more than `time_limit` seconds of CPU on it gets the worker killed (SIGKILL: a native
compile cannot be interrupted any other way) and a `WorkerFailure`; so does a worker that dies or hits its memory
cap.
CPU time, not wall time, is what a constraint costs: on a busy host a worker gets a fraction of a core, and a
schema that compiles in 5 s alone must not fail there. Where the worker's CPU time cannot be read (no
/proc), wall time counts instead; either way `WALL_GUARD` times the limit in wall time ends a request whatever
its worker did. The next request starts a fresh worker. Replies are plain JSON lines read from our own child's
pipe, never unpickled.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable

log = logging.getLogger("grammar.workers")
WORKER_WAIT_NOTE = "a grammar request waited for a compile worker to start"
START_TIMEOUT = 120.0  # importing torch and xgrammar on a loaded host
WALL_GUARD = 10.0  # a request's wall time may reach this many times its CPU limit (a starved or stuck worker)
POLL_S = 0.1  # how often a compiling worker's CPU time is read
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds process `pid` has used, from /proc; None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime: fields 14 and 15 of proc(5)


_spare: subprocess.Popen[bytes] | None = None  # `prestart`'s process, until a pool adopts it
_spare_lock = threading.Lock()


def _spawn() -> subprocess.Popen[bytes]:
    """A new compile worker process; it imports xgrammar at once, then waits for its setup line."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "ringserve.kernels.grammar.compile_worker"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def prestart() -> None:
    """Start one compile worker process now, before any pool exists (the module's docstring); the next worker a
    pool of this process starts is this one. Idempotent while it waits; it ends with this process."""
    global _spare
    with _spare_lock:
        if _spare is None or _spare.poll() is not None:
            _spare = _spawn()


def _take_spare() -> subprocess.Popen[bytes] | None:
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    return spare if spare is not None and spare.poll() is None else None


def _end_spare() -> None:
    spare = _take_spare()
    if spare is not None:
        spare.kill()
        spare.wait()


atexit.register(_end_spare)  # a spare no pool adopted ends with this process (it also watches for that itself)
_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def shed_idle_workers() -> int:
    """End every idle compile worker of this process's pools, and a spare no pool took: about 200 MB each. The
    pools stay open and start a worker again when a request needs one (the test suite calls this after each
    module, whose engines would otherwise keep their workers to its end). How many ended."""
    ended = sum(pool.shed_idle() for pool in list(_pools))
    spare = _take_spare()
    if spare is not None:
        spare.kill()
        spare.wait()
        ended += 1
    return ended


class WorkerFailure(Exception):
    """A request the worker could not answer: `reason` is "timeout", "memory", "unbounded", "crashed" or
    "unavailable" (no worker could be started)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class CompileWorker:
    """One child process and its pipes; one request at a time."""

    def __init__(self, setup_line: bytes, on_stderr: Callable[[str], None],
                 proc: subprocess.Popen[bytes] | None = None) -> None:
        """Start a worker process (or set up `proc`, one `prestart` began) and wait until it is ready."""
        self._on_stderr = on_stderr
        self._buffer = b""
        self.proc = proc if proc is not None else _spawn()
        try:
            self.limit_bytes = int(self._exchange(setup_line, START_TIMEOUT, cpu=False).get("limit_bytes", 0))
        except WorkerFailure as exc:  # not the grammar's fault: no request is failed as if it were
            raise WorkerFailure("unavailable", f"the grammar compiler process did not start: {exc}") from None

    def request(self, message: dict[str, Any], time_limit: float) -> dict[str, Any]:
        """The worker's reply to `message`; WorkerFailure (and the worker killed) when it spent `time_limit` CPU
        seconds on it (see the module's docstring) without one."""
        return self._exchange(json.dumps(message).encode() + b"\n", time_limit)

    def alive(self) -> bool:
        """Whether the process still runs (a worker that hit its cap exits after replying)."""
        return self.proc.poll() is None

    def kill(self) -> None:
        """End the process at once and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()

    def _exchange(self, line: bytes, time_limit: float, *, cpu: bool = True) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            raise WorkerFailure("crashed", "the grammar compiler process is gone") from None
        reply = json.loads(self._read_line(time_limit, cpu))
        printed = reply.pop("stderr", None)
        if printed:
            self._on_stderr(printed)
        return reply

    def _read_line(self, time_limit: float, cpu: bool) -> bytes:
        """The worker's next line: `time_limit` bounds its CPU time when `cpu` (and /proc tells it), else wall."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        started_wall = time.monotonic()
        started_cpu = process_cpu_seconds(self.proc.pid) if cpu else None
        wall_limit = time_limit if started_cpu is None else time_limit * WALL_GUARD
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                wall_left = started_wall + wall_limit - time.monotonic()
                cpu_now = None if started_cpu is None else process_cpu_seconds(self.proc.pid)
                over_cpu = cpu_now is not None and started_cpu is not None and cpu_now - started_cpu > time_limit
                if over_cpu or wall_left <= 0:
                    self.kill()
                    raise WorkerFailure("timeout", f"it took more than {time_limit:g} CPU seconds to compile")
                if not selector.select(min(wall_left, POLL_S)):
                    continue
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    try:  # its own exit status says more than our SIGKILL would
                        self.proc.wait(timeout=2.0)
                    except subprocess.TimeoutExpired:
                        pass
                    self.kill()
                    code = self.proc.returncode
                    reason = "memory" if code in (-6, -9, 134, 137) else "crashed"
                    raise WorkerFailure(reason, f"the grammar compiler process ended ({code}) while compiling it")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line


class WorkerPool:
    """Up to `size` compile workers for one tokenizer, shared by the compiler's threads."""

    def __init__(self, setup: dict[str, Any], *, size: int, time_limit: float,
                 on_stderr: Callable[[str], None]) -> None:
        self._setup_line = json.dumps(setup).encode() + b"\n"
        self._size = max(1, size)
        self.time_limit = time_limit
        self._on_stderr = on_stderr
        self._idle: list[CompileWorker] = []
        self._count = 0  # workers started or starting
        self._starting = 0
        self._closed = False
        self._cond = threading.Condition()
        _pools.add(self)

    def start(self) -> None:
        """Start one worker now (so the first request does not pay for it)."""
        self._release(self._acquire())

    def fill(self) -> int:
        """Start workers until `size` run (each a cold start: seconds of CPU importing torch and xgrammar); how
        many run or start then. WorkerFailure when one cannot be started (the next request tries again)."""
        while True:
            with self._cond:
                if self._closed or self._count >= self._size:
                    return self._count
                self._count += 1
            self._release(self._start_worker())

    def running(self) -> int:
        """How many worker processes have started and run (idle or compiling; not those still starting)."""
        with self._cond:
            busy = self._count - len(self._idle) - self._starting
            return sum(1 for worker in self._idle if worker.alive()) + busy

    def request(self, message: dict[str, Any], time_limit: float | None = None) -> dict[str, Any]:
        """A worker's reply to `message` (see compile_worker's protocol); WorkerFailure when it has none.

        A reply with `fatal` (the worker hit its cap and exits) is turned into a WorkerFailure as well."""
        worker = self._acquire(note=str(message.get("op", "")))
        try:
            reply = worker.request(message, self.time_limit if time_limit is None else time_limit)
        except BaseException:
            self._forget(worker)
            raise
        if reply.get("fatal") or not worker.alive():
            worker.kill()
            self._forget(worker)
            raise WorkerFailure(str(reply.get("reason", "crashed")), str(reply.get("error", "the worker ended")))
        self._release(worker)
        return reply

    def close(self) -> None:
        """Kill every idle worker; busy ones are killed when their request ends."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.kill()

    def shed_idle(self) -> int:
        """Kill the idle workers and leave the pool open (a request starts one again); how many."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.kill()
        return len(idle)

    def _acquire(self, note: str = "") -> CompileWorker:
        """An idle worker, or a new one; with `note` (a request's op), a new one's start is logged."""
        with self._cond:
            while True:
                if self._closed:
                    raise WorkerFailure("crashed", "the grammar compiler is closed")
                if self._idle:
                    return self._idle.pop()
                if self._count < self._size:
                    self._count += 1
                    break
                self._cond.wait()
        started = time.monotonic()
        worker = self._start_worker()
        if note:
            log.info("%s (op %s, %.2f s)", WORKER_WAIT_NOTE, note, time.monotonic() - started)
        return worker

    def _start_worker(self) -> CompileWorker:
        """A new worker, counted already (forgotten again when it cannot start)."""
        with self._cond:
            self._starting += 1
        try:
            worker = CompileWorker(self._setup_line, self._on_stderr, _take_spare())
        except BaseException:
            with self._cond:
                self._starting -= 1
            self._forget(None)
            raise
        with self._cond:
            self._starting -= 1
        return worker

    def _release(self, worker: CompileWorker) -> None:
        with self._cond:
            if self._closed:
                self._count -= 1
                worker.kill()
            else:
                self._idle.append(worker)
            self._cond.notify()

    def _forget(self, worker: CompileWorker | None) -> None:
        if worker is not None:
            worker.kill()
        with self._cond:
            self._count -= 1
            self._cond.notify()
