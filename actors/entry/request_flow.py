"""One HTTP request's trip through the ring: submit, wait for outputs, abort if the client goes away."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import anyio
from starlette.requests import Request

from actors.entry.errors import ApiError
from bus.messages import ErrorInfo, GenerateRequest, InfoQuery, RequestOutput, SchedulerInfo
from bus.ring_client import RequestStream, RingClient, RingUnavailable
from observability.traceparent import TRACEPARENT_HEADER, child_traceparent


class ClientDisconnected(Exception):
    """The HTTP client went away before the request finished (the request has been aborted)."""


class DisconnectWatch:
    """Notices an HTTP client's disconnect while a non-streamed response is still being produced."""

    def __init__(self, request: Request) -> None:
        self._task = asyncio.ensure_future(self._watch(request))

    @staticmethod
    async def _watch(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def next(self, stream: RequestStream) -> RequestOutput:
        """The stream's next output; if the client disconnects first, abort and raise ClientDisconnected."""
        pending = asyncio.ensure_future(stream.next())
        done, _ = await asyncio.wait({pending, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if pending in done:
            return pending.result()
        pending.cancel()
        await stream.abort("client disconnected")
        raise ClientDisconnected(stream.rid)

    def close(self) -> None:
        self._task.cancel()


class EntryService:
    """The entry's view of the ring: live rids, request submission, scheduler queries."""

    def __init__(self, client: RingClient, served_model: str, info_timeout: float = 3.0) -> None:
        self.client = client
        self.served_model = served_model
        self.info_timeout = info_timeout
        self.live: dict[str, RequestStream] = {}

    async def start(self, request: Request, gen_req: GenerateRequest) -> tuple[RequestStream, RequestOutput]:
        """Submit and wait for the first output, so parameter errors become HTTP errors before any byte is sent.

        The caller must finish with `outputs(...)` or `release(...)`.
        """
        if gen_req.rid in self.live:
            raise ApiError(f"request id {gen_req.rid!r} is already in use", param="rid")
        traceparent = child_traceparent(request.headers.get(TRACEPARENT_HEADER))
        try:
            stream = await self.client.submit(gen_req, traceparent)
        except RingUnavailable as exc:
            raise ApiError(str(exc), 503, type="server_error") from exc
        self.live[gen_req.rid] = stream
        watch = DisconnectWatch(request)
        try:
            first = await watch.next(stream)
        except BaseException:
            await self.release(stream)
            raise
        finally:
            watch.close()
        if first.error is not None:
            await self.release(stream)
            raise ApiError.from_info(first.error)
        return stream, first

    async def outputs(self, stream: RequestStream, first: RequestOutput,
                      watch: DisconnectWatch | None = None) -> AsyncIterator[RequestOutput]:
        """All outputs from `first` to the last; aborts the request if the consumer stops early."""
        try:
            yield first
            while not stream.finished:
                yield await (watch.next(stream) if watch else stream.next())
        finally:
            with anyio.CancelScope(shield=True):
                await self.release(stream)

    async def release(self, stream: RequestStream) -> None:
        """Forget the rid; abort the request if it is still running."""
        self.live.pop(stream.rid, None)
        await stream.abort("client disconnected")

    def fail_all(self, message: str) -> None:
        """End every in-flight request with a 503 error instead of leaving its client waiting."""
        for stream in list(self.live.values()):
            stream.fail(ErrorInfo(message=message, type="server_error", code=503))

    async def scheduler_info(self) -> SchedulerInfo:
        """The scheduler's load report; ApiError 503 if it does not answer."""
        try:
            return await self.client.bus.request(self.client.subjects.scheduler_info, InfoQuery(), SchedulerInfo,
                                                 timeout=self.info_timeout)
        except asyncio.TimeoutError as exc:
            raise ApiError(f"the scheduler did not answer: {exc}", 503, type="server_error") from exc
