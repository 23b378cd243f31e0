"""One HTTP request's trip through the ring (submit, wait for outputs, abort if the client goes away), and the
entry's other bus conversations: scheduler info, operator commands, aborts, a health-check generation."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import anyio
from starlette.requests import Request

from actors.entry.errors import ApiError
from bus.messages import ControlReply, ErrorInfo, GenerateRequest, InfoQuery, RequestOutput, SchedulerInfo
from bus.ring_client import RequestStream, RingClient, RingUnavailable
from bus.subjects import InvalidRidError, new_rid, validate_rid
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
        try:
            done, _ = await asyncio.wait({pending, self._task}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: do not leave the read behind
            pending.cancel()
            raise
        if pending in done:
            return pending.result()
        pending.cancel()
        await stream.abort("client disconnected")
        raise ClientDisconnected(stream.rid)

    def close(self) -> None:
        self._task.cancel()


class EntryService:
    """The entry's view of the ring: live rids, request submission, scheduler queries and commands."""

    def __init__(self, client: RingClient, served_model: str, info_timeout: float = 3.0,
                 control_timeout: float = 5.0, health_timeout: float = 20.0) -> None:
        self.client = client
        self.served_model = served_model
        self.info_timeout = info_timeout
        self.control_timeout = control_timeout
        self.health_timeout = health_timeout
        self.live: dict[str, RequestStream] = {}
        self.groups: dict[str, list[str]] = {}  # response rid -> the rids of its choices, while n > 1 run

    async def start(self, request: Request, gen_req: GenerateRequest) -> tuple[RequestStream, RequestOutput]:
        """Submit and wait for the first output, so parameter errors become HTTP errors before any byte is sent.

        The caller must finish with `outputs(...)` or `release(...)`.
        """
        [(stream, first)] = await self.start_many(request, [gen_req])
        return stream, first

    async def start_many(self, request: Request,
                         gen_reqs: list[GenerateRequest]) -> list[tuple[RequestStream, RequestOutput]]:
        """`start` for several requests at once (the choices of one response), submitted concurrently.

        If any of them fails to start (an error as its first output, no tokenizer, a client disconnect), all of
        them are released and the first failure is raised. The caller must release every stream returned.
        """
        for gen_req in gen_reqs:
            if gen_req.rid in self.live:
                raise ApiError(f"request id {gen_req.rid!r} is already in use", param="rid")
        streams = await self._submit_all(request, gen_reqs)
        watch = DisconnectWatch(request)
        try:
            firsts = await asyncio.gather(*(watch.next(stream) for stream in streams))
        except BaseException:
            await self.release_all(streams)
            raise
        finally:
            watch.close()
        error = next((first.error for first in firsts if first.error is not None), None)
        if error is not None:
            await self.release_all(streams)
            raise ApiError.from_info(error)
        return list(zip(streams, firsts))

    async def _submit_all(self, request: Request, gen_reqs: list[GenerateRequest]) -> list[RequestStream]:
        header = request.headers.get(TRACEPARENT_HEADER)
        results = await asyncio.gather(*(self.client.submit(gen_req, child_traceparent(header))
                                         for gen_req in gen_reqs), return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        for stream in streams:
            self.live[stream.rid] = stream
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            await self.release_all(streams)
            if isinstance(failure, RingUnavailable):
                raise ApiError(str(failure), 503, type="server_error") from failure
            raise failure
        return streams

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

    async def release_all(self, streams: list[RequestStream]) -> None:
        """`release` each stream, even while the caller is being cancelled."""
        with anyio.CancelScope(shield=True):
            for stream in streams:
                await self.release(stream)

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

    async def command(self, action: str) -> ControlReply:
        """Send an operator command ("flush_cache", "abort_all", "pause", "continue") to the scheduler.

        ApiError 503 if it does not answer within `control_timeout` seconds.
        """
        try:
            return await self.client.command(action, self.control_timeout)
        except asyncio.TimeoutError as exc:
            raise ApiError(f"the scheduler did not answer: {exc}", 503, type="server_error") from exc

    async def abort(self, rid: object) -> list[str]:
        """Abort request `rid` (any client's) and, if it names an n > 1 response of this entry, its choices.

        Returns the rids an abort was published for; ApiError 400 for an invalid rid.
        """
        try:
            rid = validate_rid(rid)
        except InvalidRidError as exc:
            raise ApiError(str(exc), param="rid") from exc
        rids = [rid, *self.groups.get(rid, [])]
        for each in rids:
            await self.client.abort(each, "abort_request")
        return rids

    async def health_generate(self) -> None:
        """Generate one greedy token through the whole ring; ApiError 503 unless it arrives in `health_timeout` s."""
        gen_req = GenerateRequest(rid=f"health_generate-{new_rid()}", text="hi",
                                  sampling={"max_new_tokens": 1, "temperature": 0})
        stream: RequestStream | None = None

        async def first_output() -> RequestOutput:
            nonlocal stream
            stream = await self.client.submit(gen_req)
            self.live[gen_req.rid] = stream
            return await stream.next()

        try:
            out = await asyncio.wait_for(first_output(), self.health_timeout)
        except asyncio.TimeoutError as exc:
            if stream is None:  # the submission itself hung: abort in case it reaches the scheduler later
                await self.client.abort(gen_req.rid, "health check timed out")
            raise ApiError(f"no generated token within {self.health_timeout:g}s", 503, type="server_error") from exc
        except RingUnavailable as exc:
            raise ApiError(str(exc), 503, type="server_error") from exc
        finally:
            if stream is not None:
                await self.release_all([stream])
        if out.error is not None:
            raise ApiError(f"the health check generation failed: {out.error.message}", 503, type="server_error")
