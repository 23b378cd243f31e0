"""Entry actor: serves the HTTP API with uvicorn inside the actor's event loop, next to its bus connection."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Iterator

import uvicorn

from actors.common.runtime import ActorContext
from actors.entry.app import build_app
from actors.entry.request_flow import EntryService
from bus.ring_client import RingClient


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the actor runtime owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def entry_main(ctx: ActorContext, host: str, port: int, served_model: str) -> dict[str, Any]:
    """Start the HTTP server; the actor fails if it cannot listen or stops on its own."""
    service = EntryService(RingClient(ctx.bus, ctx.subjects), served_model)
    config = uvicorn.Config(build_app(service), host=host, port=port, log_level="warning", access_log=False,
                            lifespan="off", timeout_graceful_shutdown=5)
    server = _EmbeddedUvicorn(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        if task.done():
            raise RuntimeError(f"the HTTP server could not start on {host}:{port} (is the port in use?)")
        await asyncio.sleep(0.05)

    def on_done(_: asyncio.Task[None]) -> None:
        if not ctx.stopping.is_set():
            ctx.fail("the HTTP server stopped")

    task.add_done_callback(on_done)

    async def stop_server() -> None:
        service.fail_all("the server is shutting down")
        server.should_exit = True
        await task

    ctx.on_stop.append(stop_server)
    return {"url": f"http://{host}:{port}"}
