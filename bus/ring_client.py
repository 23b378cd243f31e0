"""Submit a request to the ring and stream its outputs: what the HTTP entry (or any Python client) uses.

The protocol, for clients in any language: subscribe to `{ns}.out.{rid}`, publish a GenerateRequest on
`{ns}.req.submit` (as a NATS request, to get an `Accepted` reply once a tokenizer has it; a plain
publish works too), read RequestOutput deltas until one has `finish` or `error`; publish an AbortRequest on
`{ns}.abort.{rid}` to stop early. Operator commands (pause, flush the prefix cache, abort everything) are
NATS requests on `{ns}.control.scheduler.command`, answered by the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, AsyncIterator

from nats.aio.subscription import Subscription

from ringserve.bus.connection import BusConnection, Delivery
from ringserve.bus.errors import ApiError, server_error
from ringserve.bus.messages import (
    AbortRequest, Accepted, ControlCommand, ControlReply, GenerateRequest, Heartbeat, InfoQuery,
    RequestOutput, SchedulerInfo,
)
from ringserve.bus.replica_replies import asked, combined_reply
from ringserve.bus.subjects import Subjects, scoped_rid, validate_rid
from ringserve.observability.logging import log_event

log = logging.getLogger("bus")
# The reason of an operator's abort (`/abort_request`, any rid, live or not): the scheduler does not keep such an
# abort for a request that has not arrived (only the entry's own aborts can overtake their request on the bus),
# so aborting a rid that is not live does not refuse a later request that reuses it.
OPERATOR_ABORT = "abort_request"
TRACK_SETTLE_SECONDS = 0.6  # just over one heartbeat interval (actors/common/runtime.py HEARTBEAT_SECONDS)


class RingUnavailable(Exception):
    """No tokenizer took the submission: nothing is serving this namespace, or it is stuck."""


class RequestStream:
    """The outputs of one submitted request, in order, ending in exactly one terminal output.

    The terminal output is the ring's last one (`finish` or `error`) or a local error the ring did not send:
    a gap in `seq` (an output was lost), no output for `stall_timeout` seconds, or `fail()` (this process
    shuts down, or an actor the request depends on died). A local error also publishes an AbortRequest, so
    the request never runs on without a reader. Closing the stream early (`abort`) aborts the request too.
    """

    def __init__(self, bus: BusConnection, subjects: Subjects, rid: str, traceparent: str | None,
                 stall_timeout: float | None = None, submit_subject: str | None = None) -> None:
        """`rid`: the rid inside the ring (`c~rid` for NATS client c's request, which it submits on
        `submit_subject`, its `{ns}.client.{c}.submit`; default `{ns}.req.submit`)."""
        self.rid = rid
        self._submit_subject = submit_subject or subjects.submit
        self.finished = False  # the reader has taken the terminal output, or the stream was aborted
        self.terminal: RequestOutput | None = None  # the terminal output the reader took
        self.stall_timeout = stall_timeout
        self._bus = bus
        self._subjects = subjects
        self._traceparent = traceparent
        self._pending: deque[RequestOutput] = deque()
        self._arrived = asyncio.Event()
        self._sub: Subscription | None = None
        self._next_seq = 0
        self._ended = False  # the terminal output is queued: later outputs are dropped
        self._local_end: str | None = None  # why the stream ended locally (the request needs an abort)
        self._abort_sent = False
        self._last_progress = time.monotonic()
        self.replica: int | None = None  # the scheduler replica that took the request, once one did
        self.detokenizer: int | None = None  # the detokenizer its rows go to, once a scheduler took it

    async def _open(self, request: GenerateRequest, timeout: float) -> None:
        async def on_output(out: RequestOutput, delivery: Delivery) -> None:
            self._deliver(out)

        self._sub = await self._bus.subscribe(self._subjects.output(self.rid), RequestOutput, on_output)
        try:
            accepted = await self._bus.request(self._submit_subject, request, Accepted, timeout, self._traceparent)
            self.replica, self.detokenizer = accepted.replica, accepted.detokenizer
        except asyncio.TimeoutError as exc:
            # a late tokenizer may still take it: abort, or it would run with no one reading (a ghost request)
            await self.abort("submission timed out")
            raise RingUnavailable(f"no tokenizer accepted the request: {exc}") from exc
        except BaseException:  # cancelled or failed while waiting: leave neither subscription nor request
            await self.abort("submission failed")
            raise
        self._last_progress = time.monotonic()

    def _deliver(self, out: RequestOutput) -> None:
        """Queue an output from the ring, checking its sequence number."""
        if self._ended or out.rid != self.rid:
            return
        if out.seq < self._next_seq:
            log_event(log, logging.WARNING, "dropped duplicate output", rid=self.rid, seq=out.seq,
                      expected=self._next_seq)
            return
        if out.seq > self._next_seq:
            self._end_locally(f"lost output: expected seq {self._next_seq} of request {self.rid}, got {out.seq}",
                              "lost output")
            return
        self._next_seq += 1
        self._last_progress = time.monotonic()
        self._ended = out.is_last
        self._push(out)

    def _end_locally(self, message: str, reason: str) -> None:
        """Queue a terminal 503 error the ring did not send; the reader's `next` then aborts the request."""
        if self._ended:
            return
        self._ended = True
        self._local_end = reason
        log_event(log, logging.WARNING, "request stream failed", rid=self.rid, error=message)
        self._push(RequestOutput(rid=self.rid, seq=self._next_seq,
                                 error=server_error(message, 503)))

    def _push(self, out: RequestOutput) -> None:
        self._pending.append(out)
        self._arrived.set()

    async def next(self) -> RequestOutput:
        """The next output delta; after the terminal one (finish or error) the stream is finished.

        Waits at most until `stall_timeout` seconds after the last progress; then the terminal output is a
        503 error and the request is aborted.
        """
        if self.finished:
            raise RuntimeError(f"the stream of request {self.rid} is finished")
        while not self._pending:
            self._arrived.clear()
            if self.stall_timeout is None:
                await self._arrived.wait()
                continue
            remaining = self._last_progress + self.stall_timeout - time.monotonic()
            if remaining <= 0:
                self._end_locally(f"no output for request {self.rid} within {self.stall_timeout:g}s", "stalled")
                break
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        out = self._pending.popleft()
        if out.is_last:
            self.finished = True
            self.terminal = out
            await self._unsubscribe()
            if self._local_end is not None:
                await self._send_abort(self._local_end)
        return out

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.next()

    async def fail(self, error: ApiError, reason: str = "failed") -> None:
        """End the stream locally with `error` (the reader's next output) and abort the request now.

        For when this process shuts down or an actor the request depends on went silent: the abort is sent
        here, not left to a reader that may never run again.
        """
        if self._ended:
            return
        self._ended = True
        self._local_end = reason
        self._push(RequestOutput(rid=self.rid, seq=self._next_seq, error=error))
        await self._send_abort(reason)

    async def abort(self, reason: str = "client") -> None:
        """Ask the scheduler to stop this request and free its KV cache now (once; no-op after the end)."""
        if not self.finished:
            self.finished = True
            self._ended = True
            await self._unsubscribe()
            await self._send_abort(reason)

    async def _send_abort(self, reason: str) -> None:
        if self._abort_sent:
            return
        self._abort_sent = True
        await self._bus.publish(self._subjects.abort(self.rid), AbortRequest(rid=self.rid, reason=reason),
                                self._traceparent)

    async def _unsubscribe(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()


class RingClient:
    """Submits GenerateRequests over one bus connection."""

    def __init__(self, bus: BusConnection, subjects: Subjects, submit_timeout: float = 30.0,
                 stall_timeout: float | None = None, client: str | None = None) -> None:
        """`stall_timeout`: seconds a stream may go without output before it ends with an error (None: never).
        `client`: submit as NATS client `client` on its own `{ns}.client.{c}.*` subjects (streams then carry the
        scoped rid `c~rid`); None: on the unscoped subjects, as the entry does."""
        self.client = validate_rid(client) if client is not None else None
        self.bus = bus
        self.subjects = subjects
        self.submit_timeout = submit_timeout
        self.stall_timeout = stall_timeout
        self._replicas: dict[int, tuple[float, Heartbeat]] = {}  # replica id -> (when its last beat came, the beat)
        self._tracking_since: float | None = None

    def stream(self, rid: str, traceparent: str | None = None) -> RequestStream:
        """A not yet submitted stream for `rid` (no bus traffic); `open` submits it."""
        if self.client is not None:
            return RequestStream(self.bus, self.subjects, scoped_rid(self.client, rid), traceparent,
                                 self.stall_timeout, self.subjects.client_submit(self.client))
        return RequestStream(self.bus, self.subjects, validate_rid(rid), traceparent, self.stall_timeout)

    async def open(self, stream: RequestStream, request: GenerateRequest) -> None:
        """Subscribe to the stream's output subject, then submit `request` and wait for a tokenizer to take it.

        Raises RingUnavailable (the request aborted) if no tokenizer accepts it within `submit_timeout` seconds.
        """
        ring_rid = scoped_rid(self.client, request.rid) if self.client is not None else request.rid
        if ring_rid != stream.rid:
            raise ValueError(f"request {request.rid!r} opened on the stream of {stream.rid!r}")
        await stream._open(request, self.submit_timeout)

    async def submit(self, request: GenerateRequest, traceparent: str | None = None) -> RequestStream:
        """`stream` and `open` in one: the request's stream once a tokenizer has accepted it."""
        stream = self.stream(request.rid, traceparent)
        await self.open(stream, request)
        return stream

    async def abort(self, rid: str, reason: str = "client", traceparent: str | None = None) -> None:
        """Ask the scheduler to stop request `rid` (any client's); raises InvalidRidError for a bad rid."""
        await self.bus.publish(self.subjects.abort(rid), AbortRequest(rid=rid, reason=reason), traceparent)

    async def command(self, command: str | ControlCommand, timeout: float = 5.0, traceparent: str | None = None,
                      expected: int = 1, **arguments: Any) -> ControlReply:
        """Send a ControlCommand (an action, with `arguments` its other fields, e.g. `model_path`) to every
        scheduler replica and combine the answers of `expected` of them (bus/replica_replies.py: not ok when
        fewer answer); raises asyncio.TimeoutError when none answers within `timeout` seconds."""
        if isinstance(command, str):
            command = ControlCommand(action=command, **arguments)
        replies = await self.bus.gather(self.subjects.scheduler_command, command, ControlReply, max(1, expected),
                                        timeout, traceparent)
        if not replies:
            raise asyncio.TimeoutError(f"no scheduler answered {command.action!r} within {timeout:g} s")
        return combined_reply(replies, expected)

    async def infos(self, expected: int = 1, timeout: float = 5.0) -> list[SchedulerInfo]:
        """The load reports of `expected` scheduler replicas (or those that answered within `timeout` seconds),
        by replica id; raises asyncio.TimeoutError when none answers."""
        infos = await self.bus.gather(self.subjects.scheduler_info, InfoQuery(), SchedulerInfo, max(1, expected),
                                      timeout)
        if not infos:
            raise asyncio.TimeoutError(f"no scheduler answered within {timeout:g} s")
        return sorted(infos, key=lambda info: info.rank)

    async def track_replicas(self) -> None:
        """Follow the scheduler replicas' heartbeats, so `replicas_to_ask` can say how many answer a command."""
        async def on_heartbeat(beat: Heartbeat, delivery: Delivery) -> None:
            if beat.load is not None:
                self._replicas[beat.load.replica] = (time.monotonic(), beat)

        self._tracking_since = time.monotonic()
        await self.bus.subscribe(self.subjects.heartbeat, Heartbeat, on_heartbeat)

    async def replicas_to_ask(self) -> int:
        """How many scheduler replicas a command should wait for (bus/replica_replies.py `asked`; 0 unless
        `track_replicas`); waits out the first heartbeat interval after tracking starts, so every replica has
        had a chance to beat."""
        if self._tracking_since is None:
            return 0
        settle = self._tracking_since + TRACK_SETTLE_SECONDS - time.monotonic()
        if settle > 0:
            await asyncio.sleep(settle)
        now = time.monotonic()
        return sum(1 for seen, beat in self._replicas.values()
                   if beat.load is not None and asked(beat.load, beat.live_rids, now - seen))

    async def wait_for_replicas(self, count: int, timeout: float) -> int:
        """Wait until `count` scheduler replicas have beat since `track_replicas`, or `timeout` seconds; how many
        did. For a ring this process just started: a replica busy past the first heartbeat interval (its first
        steps on a loaded host) would not be counted by the first command."""
        deadline = time.monotonic() + timeout
        seen = await self.replicas_to_ask()
        while self._tracking_since is not None and seen < count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            seen = await self.replicas_to_ask()
        return seen
