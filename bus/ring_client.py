"""Submit a request to the ring and stream its outputs: what the HTTP entry (or any Python client) uses.

The protocol, for clients in any language: subscribe to `{ns}.out.{rid}`, publish a GenerateRequest on
`{ns}.req.submit` (as a NATS request, to get an `Accepted` reply once a tokenizer has it; a plain
publish works too), read RequestOutput deltas until one has `finish` or `error`; publish an AbortRequest on
`{ns}.abort.{rid}` to stop early. Operator commands (pause, flush the prefix cache, abort everything) are
NATS requests on `{ns}.control.scheduler.command`, answered by the scheduler.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from nats.aio.subscription import Subscription

from bus.connection import BusConnection, Delivery
from bus.messages import (
    AbortRequest, Accepted, ControlCommand, ControlReply, ErrorInfo, GenerateRequest, RequestOutput,
)
from bus.subjects import Subjects, validate_rid


class RingUnavailable(Exception):
    """No tokenizer took the submission: nothing is serving this namespace, or it is stuck."""


class RequestStream:
    """The outputs of one submitted request, in order; closing it early aborts the request."""

    def __init__(self, bus: BusConnection, subjects: Subjects, rid: str, traceparent: str | None) -> None:
        self.rid = rid
        self.finished = False
        self._bus = bus
        self._subjects = subjects
        self._traceparent = traceparent
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._sub: Subscription | None = None

    async def _open(self, request: GenerateRequest, timeout: float) -> None:
        async def on_output(out: RequestOutput, delivery: Delivery) -> None:
            self._queue.put_nowait(out)

        self._sub = await self._bus.subscribe(self._subjects.output(self.rid), RequestOutput, on_output)
        try:
            await self._bus.request(self._subjects.submit, request, Accepted, timeout, self._traceparent)
        except asyncio.TimeoutError as exc:
            self.finished = True
            await self._unsubscribe()
            raise RingUnavailable(f"no tokenizer accepted the request: {exc}") from exc
        except BaseException:  # cancelled while waiting: do not leave the subscription behind
            self.finished = True
            await self._unsubscribe()
            raise

    async def next(self) -> RequestOutput:
        """The next output delta; after the last one (finish or error) the stream is finished."""
        out = await self._queue.get()
        if out.is_last:
            self.finished = True
            await self._unsubscribe()
        return out

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.next()

    def fail(self, error: ErrorInfo) -> None:
        """End the stream locally with `error` (the reader's next output), e.g. when this process shuts down."""
        if not self.finished:
            self._queue.put_nowait(RequestOutput(rid=self.rid, error=error))

    async def abort(self, reason: str = "client") -> None:
        """Ask the scheduler to stop this request and free its KV cache now."""
        if not self.finished:
            self.finished = True
            await self._unsubscribe()
            await self._bus.publish(self._subjects.abort(self.rid), AbortRequest(rid=self.rid, reason=reason),
                                    self._traceparent)

    async def _unsubscribe(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()


class RingClient:
    """Submits GenerateRequests over one bus connection."""

    def __init__(self, bus: BusConnection, subjects: Subjects, submit_timeout: float = 30.0) -> None:
        self.bus = bus
        self.subjects = subjects
        self.submit_timeout = submit_timeout

    async def submit(self, request: GenerateRequest, traceparent: str | None = None) -> RequestStream:
        """Subscribe to the request's output subject, then submit it and wait for a tokenizer to accept it.

        Raises RingUnavailable if no tokenizer accepts it within `submit_timeout` seconds.
        """
        validate_rid(request.rid)
        stream = RequestStream(self.bus, self.subjects, request.rid, traceparent)
        await stream._open(request, self.submit_timeout)
        return stream

    async def abort(self, rid: str, reason: str = "client", traceparent: str | None = None) -> None:
        """Ask the scheduler to stop request `rid` (any client's); raises InvalidRidError for a bad rid."""
        await self.bus.publish(self.subjects.abort(rid), AbortRequest(rid=rid, reason=reason), traceparent)

    async def command(self, action: str, timeout: float = 5.0, traceparent: str | None = None) -> ControlReply:
        """Send a ControlCommand to the scheduler and return its reply (raises asyncio.TimeoutError)."""
        return await self.bus.request(self.subjects.scheduler_command, ControlCommand(action=action), ControlReply,
                                      timeout, traceparent)
