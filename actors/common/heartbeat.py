"""An actor's heartbeat, sent from a thread of its own so that a busy actor never looks dead.

The actor's event loop may be busy for seconds (a long engine step's Python, a burst of outputs to encode, an
import): a beat sent from that loop would come late, and the entry would end every stream the actor holds. So
`Heartbeat` runs a daemon thread with its own small asyncio loop and its own NATS connection (the actor's
credentials and inbox prefix) and publishes every `interval` seconds whatever the actor's loop is doing. Only a
stalled process (SIGSTOP, or the whole interpreter wedged) or a lost NATS connection silences it.

The numbers a beat carries (`live_rids`, a scheduler's `load`) are read on the actor's loop (`refresh`, every
interval, from a task there), never from the thread: they describe state only that loop touches. The thread
sends the last snapshot, and `loop_lag`, how long ago it was taken: a loop busy that long is shown, not judged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable

from ringserve.bus.connection import BusConnection
from ringserve.bus.credentials import NatsCredentials
from ringserve.bus.messages import Heartbeat, ReplicaLoad
from ringserve.observability.logging import log_event

log = logging.getLogger("actor")
CONNECT_RETRY_SECONDS = 0.5
BEAT_NOW_TIMEOUT = 2.0


@dataclass(frozen=True)
class _Snapshot:
    """What the actor's loop last said about itself, and when (time.monotonic())."""

    live_rids: int
    load: ReplicaLoad | None
    draining: bool
    taken_at: float
    counters: dict[str, int] = field(default_factory=dict)


class HeartbeatThread:
    """Publishes an actor's Heartbeat every `interval` seconds from a dedicated thread and NATS connection."""

    def __init__(self, role: str, rank: int, subject: str, interval: float,
                 connect: Callable[[], Awaitable[BusConnection]],
                 main_connected: Callable[[], bool] = lambda: True) -> None:
        """`connect`: opens this thread's own connection (called on its loop); `main_connected`: whether the
        actor's own connection is up (read from the thread: an actor cut off from NATS must fall silent, as its
        outputs cannot get through either)."""
        self.role, self.rank, self.interval = role, rank, interval
        self._subject = subject
        self._connect = connect
        self._main_connected = main_connected
        self._snapshot = _Snapshot(0, None, False, time.monotonic())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bus: BusConnection | None = None
        self._stop = threading.Event()
        self._wake: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{role}{rank}", daemon=True)
        self.beats_sent = 0

    def refresh(self, live_rids: int, load: ReplicaLoad | None, draining: bool,
                counters: dict[str, int] | None = None) -> None:
        """Take a new snapshot (call on the actor's loop). Assigning one reference is atomic under the GIL."""
        if load is not None and draining:
            load = replace(load, draining=True)
        self._snapshot = _Snapshot(live_rids, load, draining, time.monotonic(), dict(counters or {}))

    def start(self) -> None:
        """Start the thread; returns once its loop runs (its connection is made there, retried until it works)."""
        self._thread.start()
        self._started.wait(5.0)

    def beat_now(self) -> Future[None] | None:
        """Publish a beat now (e.g. to say `draining` at once); a future done once it is sent, None if not running."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return None
        try:
            return asyncio.run_coroutine_threadsafe(self._beat_and_flush(), loop)
        except RuntimeError:  # the loop stopped meanwhile
            return None

    async def beat_now_and_wait(self, timeout: float = BEAT_NOW_TIMEOUT) -> None:
        """`beat_now`, awaited from another event loop (the actor's), at most `timeout` seconds."""
        future = self.beat_now()
        if future is None:
            return
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except Exception as exc:  # best effort: a beat not sent is a beat missed
            log_event(log, logging.DEBUG, "heartbeat not sent", error=repr(exc))

    def stop(self, timeout: float = 3.0) -> None:
        """Stop beating and close the thread's connection (waits at most `timeout` seconds)."""
        self._stop.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:  # the actor goes on; its silence will show
            log.exception("the heartbeat thread stopped")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._started.set()
        while self._bus is None and not self._stop.is_set():
            try:
                self._bus = await self._connect()
            except Exception as exc:
                log_event(log, logging.WARNING, "heartbeat connection failed; retrying", error=repr(exc))
                await self._sleep(CONNECT_RETRY_SECONDS)
        while not self._stop.is_set():
            await self._beat()
            await self._sleep(self.interval)
        if self._bus is not None:
            try:
                await asyncio.wait_for(self._bus.close(), timeout=2)
            except Exception:  # closing is best effort on the way out
                pass

    async def _sleep(self, seconds: float) -> None:
        assert self._wake is not None
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()

    def heartbeat(self) -> Heartbeat:
        """The beat the last snapshot makes."""
        snap = self._snapshot
        return Heartbeat(role=self.role, rank=self.rank, pid=os.getpid(), interval=self.interval,
                         live_rids=snap.live_rids, load=snap.load, draining=snap.draining,
                         loop_lag=round(max(0.0, time.monotonic() - snap.taken_at), 3), counters=snap.counters)

    async def _beat(self) -> None:
        if self._bus is None or not self._main_connected():
            return
        try:
            await self._bus.publish(self._subject, self.heartbeat())
            self.beats_sent += 1
        except Exception as exc:  # disconnected: nats-py reconnects; keep beating
            log_event(log, logging.DEBUG, "heartbeat not sent", error=repr(exc))

    async def _beat_and_flush(self) -> None:
        await self._beat()
        if self._bus is not None:
            await self._bus.flush()
