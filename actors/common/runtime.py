"""The life of one actor process: logging, bus connection, ready announcement, orderly or fail-stop exit.

An actor's `main(ctx)` subscribes what it needs and returns a dict describing itself; the runtime then
announces `ActorReady` on `{ns}.control.ready` and serves until a signal (exit 0) or until the bus connection
is lost for good or the actor calls `ctx.fail()` (exit 1, so the launcher tears the ring down).

Heartbeats (`Heartbeat` every HEARTBEAT_SECONDS) come from a thread with its own NATS connection
(actors/common/heartbeat.py), so a busy event loop or a long engine step never silences them; the numbers they
carry are refreshed from the actor's loop.

SIGTERM/SIGINT drains: the first signal sets `ctx.draining` and runs the actor's `ctx.on_drain` hooks (each
stops its intake: unsubscribes, refuses new HTTP requests), heartbeats go on (saying `draining`), and once
`ctx.live_rids()` is 0 the actor stops. When the process that started the actor has died (the signal is its
death signal), it stops at once instead, and exits hard if that takes over `ORPHAN_EXIT_SECONDS`. A second
signal, or `--drain-timeout` seconds, stops it at once (what it still holds ends through its `on_stop` hooks).
A signal before the actor is ready stops it at once.

The actor connects with the credentials its flags name (a file path or a user name; passwords only in files or
the environment, never on the command line) and with its role's own reply-inbox prefix (bus/permissions.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from ringserve.actors.common import startup_cache
from ringserve.actors.common.actor_flags import credentials_from_args
from ringserve.actors.common.heartbeat import HeartbeatThread
from ringserve.actors.common.tracing_setup import start_tracing, stop_tracing
from ringserve.bus.connection import BusConnection
from ringserve.bus.messages import ActorReady, ReplicaLoad
from ringserve.bus.permissions import inbox_prefix
from ringserve.bus.subjects import Subjects
from ringserve.observability.logging import log_event, setup_logging

log = logging.getLogger("actor")
HEARTBEAT_SECONDS = 0.5
HOLD_ENV = "RINGSERVE_HOLD_START"  # set by the launcher: wait for its line on stdin before starting (wait_for_release)
DRAIN_POLL_SECONDS = 0.05
# How long an orphan (its parent died) may take to stop before it exits hard: the NATS server died with the
# parent, so closing the bus and flushing spans can only wait out their timeouts (nats-py's drain: 30 s), and
# a compile thread inside an import can hold the interpreter's exit as long.
ORPHAN_EXIT_SECONDS = 3.0


@dataclass
class ActorContext:
    """What an actor's main gets: its bus connection, subject names and a way to stop."""

    bus: BusConnection
    subjects: Subjects
    role: str
    rank: int
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int = 0
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # set on the first SIGTERM/SIGINT: the actor takes no new work and stops once `live_rids()` is 0
    draining: asyncio.Event = field(default_factory=asyncio.Event)
    # run once when draining starts, in order: each stops part of the actor's intake
    on_drain: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # how many requests this actor holds state for; reported in every heartbeat (0 for stateless actors)
    live_rids: Callable[[], int] = lambda: 0
    # a scheduler replica's load, in its heartbeats (what the tokenizers route by); None for other roles
    load: Callable[[], ReplicaLoad | None] = lambda: None
    # the actor's own counters, in every heartbeat (e.g. the tokenizer's image cache); empty for most actors
    counters: Callable[[], dict[str, int]] = dict
    heartbeat: HeartbeatThread | None = None  # beats from its own thread once the actor is ready

    def fail(self, reason: str) -> None:
        """Fail-stop: log why and end the process with exit code 1."""
        log_event(log, logging.ERROR, "actor failing", role=self.role, reason=reason)
        self.exit_code = 1
        self.stopping.set()


ActorMain = Callable[[ActorContext], Awaitable[dict[str, Any]]]


async def _serve(role: str, rank: int, args: argparse.Namespace, main: ActorMain) -> int:
    ctx_holder: list[ActorContext] = []

    async def on_closed() -> None:
        if ctx_holder and not ctx_holder[0].stopping.is_set():
            ctx_holder[0].fail("lost the NATS connection for good")

    credentials = credentials_from_args(args)
    bus = await BusConnection.connect(args.nats_url, f"{role}-{rank}-{os.getpid()}", on_closed=on_closed,
                                      credentials=credentials, inbox_prefix=inbox_prefix(args.namespace, role))
    ctx = ActorContext(bus=bus, subjects=Subjects(args.namespace), role=role, rank=rank)

    def connect_heartbeat() -> Awaitable[BusConnection]:  # named apart: `{role}-{rank}-` names the actor's own
        return BusConnection.connect(args.nats_url, f"heartbeat-{role}-{rank}-{os.getpid()}",
                                     credentials=credentials, inbox_prefix=inbox_prefix(args.namespace, role))

    ctx.heartbeat = HeartbeatThread(role, rank, ctx.subjects.heartbeat, HEARTBEAT_SECONDS, connect_heartbeat,
                                    main_connected=lambda: bus.client.is_connected)
    ctx_holder.append(ctx)
    await start_tracing(args, role, rank, bus, ctx.subjects)  # before main: actors look at tracing.enabled()
    loop = asyncio.get_running_loop()
    serving = False
    draining: list[asyncio.Task[None]] = []
    parent = os.getppid()

    def on_signal(sig: signal.Signals) -> None:
        # not ready yet, the second signal, or the parent died (its death signal, bus/embedded_server.py
        # `die_with_parent`: no one waits for a drain then): stop now
        orphaned = os.getppid() != parent
        if not serving or ctx.draining.is_set() or orphaned:
            log_event(log, logging.INFO, "stopping", role=role, rank=rank, signal=sig.name, orphaned=orphaned)
            ctx.stopping.set()
            if orphaned:
                threading.Thread(target=_exit_after, args=(ORPHAN_EXIT_SECONDS, ctx), name="orphan-exit",
                                 daemon=True).start()
        else:
            log_event(log, logging.INFO, "draining", role=role, rank=rank, signal=sig.name,
                      live_rids=ctx.live_rids(), timeout_s=args.drain_timeout)
            ctx.draining.set()
            draining.append(loop.create_task(_drain(ctx, args.drain_timeout)))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    detail = await main(ctx)
    await bus.publish(ctx.subjects.ready, ActorReady(role=role, rank=rank, pid=os.getpid(), detail=detail))
    await bus.flush()
    log_event(log, logging.INFO, "ready", role=role, rank=rank, pid=os.getpid(), **startup_cache.report())
    serving = True
    _refresh(ctx)
    ctx.heartbeat.start()
    refreshing = asyncio.get_running_loop().create_task(_refresh_beats(ctx))
    await ctx.stopping.wait()
    refreshing.cancel()
    for task in draining:
        task.cancel()
    if ctx.draining.is_set() and ctx.exit_code == 0:  # a last beat: it left with nothing held (or gave up)
        await _beat(ctx)
    ctx.heartbeat.stop()
    for cleanup in ctx.on_stop:
        try:
            await asyncio.wait_for(cleanup(), timeout=10)
        except Exception:
            log.exception("cleanup failed")
    try:
        await asyncio.wait_for(stop_tracing(), timeout=15)  # flush spans while the bus is still open
    except Exception:
        log.exception("flushing spans failed")
    try:
        await asyncio.wait_for(bus.close(), timeout=5)
    except Exception:  # closing is best effort on the way out
        pass
    return ctx.exit_code


def _exit_after(seconds: float, ctx: ActorContext) -> None:
    """End the process with the actor's exit code `seconds` from now, wherever its stop is waiting by then."""
    time.sleep(seconds)
    logging.shutdown()  # flush the log handlers: os._exit skips them
    os._exit(ctx.exit_code)


async def _drain(ctx: ActorContext, timeout: float) -> None:
    """Stop the intake (the actor's `on_drain` hooks), wait until nothing is held or `timeout`, then stop."""
    if ctx.stopping.is_set():  # a second signal came before this task ran
        return
    await _beat(ctx)  # say `draining` now, so routers stop choosing this actor before its intake closes
    for hook in ctx.on_drain:
        try:
            await hook()
        except Exception:  # a hook that fails must not keep the actor from stopping
            log.exception("drain hook failed")
    deadline = asyncio.get_running_loop().time() + timeout
    while ctx.live_rids() > 0 and not ctx.stopping.is_set():
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            log_event(log, logging.WARNING, "drain timed out; stopping with requests held", role=ctx.role,
                      rank=ctx.rank, live_rids=ctx.live_rids(), timeout_s=timeout)
            break
        try:
            await asyncio.wait_for(ctx.stopping.wait(), min(DRAIN_POLL_SECONDS, left))
        except asyncio.TimeoutError:
            pass
    if ctx.live_rids() == 0:
        log_event(log, logging.INFO, "drained", role=ctx.role, rank=ctx.rank)
    ctx.stopping.set()


def _refresh(ctx: ActorContext) -> None:
    """Hand the heartbeat thread this actor's numbers, read here on its event loop (a scheduler's load says
    whether it drains)."""
    if ctx.heartbeat is not None:
        ctx.heartbeat.refresh(ctx.live_rids(), ctx.load(), ctx.draining.is_set(), ctx.counters())


async def _beat(ctx: ActorContext) -> None:
    """Refresh the numbers and publish one Heartbeat now (e.g. to say `draining` at once)."""
    _refresh(ctx)
    if ctx.heartbeat is not None:
        await ctx.heartbeat.beat_now_and_wait()


async def _refresh_beats(ctx: ActorContext) -> None:
    """Refresh the heartbeat's numbers every HEARTBEAT_SECONDS from the event loop; the thread beats anyway."""
    while True:
        _refresh(ctx)
        await asyncio.sleep(HEARTBEAT_SECONDS)


class StartFailed(RuntimeError):
    """An actor cannot start for a reason its message says in full (a port in use): logged as one line, no
    traceback, and the process exits 1."""


def run_actor(role: str, args: argparse.Namespace, main: ActorMain, rank: int = 0) -> None:
    """Run `main` as this process's actor and exit with its code."""
    wait_for_release()
    setup_logging(f"{role}{rank if role == 'scheduler' else ''}", args.log_level)
    try:
        code = asyncio.run(_serve(role, rank, args, main))
    except StartFailed as exc:
        log_event(log, logging.ERROR, "could not start", role=role, reason=str(exc))
        code = 1
    except Exception:
        log.exception("%s crashed", role)
        code = 1
    exit_now(code)


def wait_for_release() -> None:
    """An actor the launcher started held (`HOLD_ENV` set: the entry, while the scheduler loads its model) has
    imported its code by now; it waits here for the launcher's line on stdin before it starts (the entry's port
    opens only once the ring behind it is ready). A stdin closed without that line (the launcher gone) ends it."""
    if os.environ.pop(HOLD_ENV, None) is None:
        return
    if not sys.stdin.readline():
        exit_now(0)


def exit_now(code: int) -> None:
    """End the process with `code` once its work is flushed and closed, skipping the interpreter's teardown
    (joining torch's and the tokenizers' threads, collecting modules: seconds on a busy host, paid by every
    stop of a ring, once per shutdown wave)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
