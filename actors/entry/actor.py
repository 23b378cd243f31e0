"""Entry actor: serves the HTTP API with uvicorn inside the actor's event loop, next to its bus connection.

Besides HTTP it listens to every actor's heartbeat (liveness: `/health`, and open streams fail fast when the
scheduler or a detokenizer holding them goes silent) and logs its own NATS disconnects and reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any, Iterator

import uvicorn

from ringserve.actors.common.runtime import ActorContext, StartFailed
from ringserve.actors.entry.app import build_app
from ringserve.actors.entry.liveness import LivenessMonitor
from ringserve.actors.entry.request_flow import EntryService
from ringserve.actors.entry.request_trace import traced_app
from ringserve.actors.entry.settings import ADMIN_API_KEY_ENV, API_KEY_ENV, EntrySettings
from ringserve.bus.connection import BusConnection, Delivery
from ringserve.bus.messages import ActorGone, Heartbeat
from ringserve.bus.ring_client import RingClient
from ringserve.observability.logging import log_event

log = logging.getLogger("entry")
STARTUP_BEAT_WAIT_SECONDS = 1.5  # at start, wait this long at most to hear every role before serving


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the actor runtime owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class NatsStateLog:
    """Logs the entry's NATS connection going down and coming back (polled: BusConnection has no hook). On a
    reconnect it ends the streams that were open when the connection went down (`service.fail_rids`): outputs
    published while this entry was away, or before its subscriptions were back, are gone, so those streams
    cannot be trusted to complete. Streams opened since go on."""

    def __init__(self, bus: BusConnection, service: EntryService | None = None) -> None:
        self._bus = bus
        self._connected = True
        self._service = service
        self._open_at_outage: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def __call__(self) -> None:
        """Check the connection once; log a change since the last check."""
        connected = self._bus.client.is_connected
        if connected != self._connected:
            self._connected = connected
            reconnects = self._bus.client.stats.get("reconnects", 0)
            log_event(log, logging.INFO if connected else logging.WARNING,
                      "nats reconnected" if connected else "nats disconnected", reconnects=reconnects)
            if self._service is None:
                return
            if not connected:
                self._open_at_outage = set(self._service.live)
                return
            task = asyncio.get_running_loop().create_task(self._service.fail_rids(
                self._open_at_outage, "the bus connection was interrupted and output may have been lost; retry",
                "bus interrupted"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


async def entry_main(ctx: ActorContext, settings: EntrySettings) -> dict[str, Any]:
    """Start the HTTP server; the actor fails if it cannot listen or stops on its own."""
    for secret in (API_KEY_ENV, ADMIN_API_KEY_ENV):  # read already; keep them out of anything this process starts
        os.environ.pop(secret, None)
    liveness = LivenessMonitor(silence_s=settings.heartbeat_timeout)
    service = EntryService(RingClient(ctx.bus, ctx.subjects, stall_timeout=settings.stall_timeout),
                           settings.served_model, max_queued_requests=settings.max_queued_requests,
                           liveness=liveness)
    ctx.live_rids = lambda: len(service.live)

    async def drain() -> None:  # finish the open streams, refuse new requests (503)
        service.draining = True

    ctx.on_drain.append(drain)

    async def on_heartbeat(beat: Heartbeat, delivery: Delivery) -> None:
        liveness.record(beat)

    async def on_gone(gone: ActorGone, delivery: Delivery) -> None:
        liveness.gone(gone.role, gone.rank, gone.pid, gone.cause)

    await ctx.bus.subscribe(ctx.subjects.heartbeat, Heartbeat, on_heartbeat)
    await ctx.bus.subscribe(ctx.subjects.gone, ActorGone, on_gone)
    await liveness.wait_for_roles(STARTUP_BEAT_WAIT_SECONDS)

    async def on_lost(names: list[str]) -> None:
        message = f"the ring lost {liveness.why_lost(names)}"
        held = liveness.degraded(names)
        if held is not None:  # others of their roles serve: degrade, ending only the streams they held
            await service.fail_held(held, message)
        else:
            await service.fail_all(message, reason="actor lost")

    loop = asyncio.get_running_loop()
    watcher = loop.create_task(liveness.watch(on_lost, on_tick=NatsStateLog(ctx.bus, service)))
    config = uvicorn.Config(traced_app(build_app(service, settings)), host=settings.host, port=settings.port,
                            log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                            log_config=None)  # uvicorn logs through our formatter (escaped), not its own
    server = _EmbeddedUvicorn(config)

    async def serve() -> None:
        try:
            await server.serve()
        except SystemExit:  # uvicorn exits when it cannot bind, after logging why: the wait below says it once
            pass

    task = loop.create_task(serve())
    while not server.started:
        if task.done():
            watcher.cancel()
            raise StartFailed(f"the HTTP server could not start on {settings.host}:{settings.port}: see the line "
                              "above (a port in use: stop what holds it or pass another --port)")
        await asyncio.sleep(0.05)

    def on_done(_: asyncio.Task[None]) -> None:
        if not ctx.stopping.is_set():
            ctx.fail("the HTTP server stopped")

    task.add_done_callback(on_done)

    async def stop_server() -> None:
        watcher.cancel()
        await service.fail_all("the server is shutting down")
        server.should_exit = True
        await task

    ctx.on_stop.append(stop_server)
    return {"url": f"http://{settings.host}:{settings.port}", "auth": settings.api_key is not None,
            "max_queued_requests": settings.max_queued_requests}
