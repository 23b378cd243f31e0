"""One HTTP request's trip through the ring (submit, wait for outputs, abort if the client goes away), and the
entry's other bus conversations: scheduler info, operator commands, aborts, a health-check generation."""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from typing import Any, AsyncIterator

import anyio
from starlette.requests import Request

from ringserve.actors.entry.errors import model_not_found, server_busy
from ringserve.actors.entry.image_input import ImageIntake
from ringserve.bus.errors import ApiError
from ringserve.actors.entry.liveness import LivenessMonitor
from ringserve.actors.entry.ops.metrics import RequestMetrics
from ringserve.actors.entry.settings import DEFAULT_MAX_QUEUED_REQUESTS
from ringserve.bus.codec import encode
from ringserve.bus.messages import ControlCommand, ControlReply, GenerateRequest, RequestOutput, SchedulerInfo
from ringserve.bus.replica_replies import combined_info
from ringserve.bus.ring_client import OPERATOR_ABORT, RequestStream, RingClient, RingUnavailable
from ringserve.bus.subjects import InvalidRidError, new_rid, validate_rid
from ringserve.actors.entry import request_trace
from ringserve.observability import tracing
from ringserve.observability.traceparent import TRACEPARENT_HEADER

log = logging.getLogger("entry")
PAYLOAD_HEADROOM = 4096  # bytes of max_payload kept for NATS headers (traceparent) and the subject


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


def resident_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class EntryService:
    """The entry's view of the ring: live rids, admission, request submission, scheduler queries and commands.

    Every request is admitted (`admit`: capacity, duplicate rid, actor liveness; no await, so two requests
    can never both take a rid) and then released exactly once (`release`), whatever ends it; the counters
    `admitted_total` and `terminal_total` are equal whenever no request is live.
    """

    def __init__(self, client: RingClient, served_model: str, info_timeout: float = 3.0,
                 control_timeout: float = 5.0, health_timeout: float = 20.0,
                 max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
                 liveness: LivenessMonitor | None = None) -> None:
        self.client = client
        self.served_model = served_model
        self.info_timeout = info_timeout
        self.control_timeout = control_timeout
        self.health_timeout = health_timeout
        self.max_queued_requests = max_queued_requests
        self.liveness = liveness or LivenessMonitor()
        self.live: dict[str, RequestStream] = {}
        self.groups: dict[str, list[str]] = {}  # response rid -> the rids of its choices, while n > 1 run
        self.admitted_total = 0
        self.terminal_total = 0
        self.terminal_by_kind: Counter[str] = Counter()  # "finish", "error", "aborted" (ended by the entry)
        self.rejected_busy_total = 0
        self.metrics = RequestMetrics(served_model)  # the requests' Prometheus series, for /metrics
        self.draining = False  # shutting down: open streams finish, new requests get a 503
        self.images: ImageIntake | None = None  # stores the images requests bring (set by app.build_app)

    def counters(self) -> dict[str, Any]:
        """The entry's request counters, as shown in /get_server_info."""
        return {"entry_admitted_total": self.admitted_total, "entry_terminal_total": self.terminal_total,
                "entry_live_requests": len(self.live), "entry_terminal_by_kind": dict(self.terminal_by_kind),
                "entry_rejected_busy_total": self.rejected_busy_total,
                "entry_max_queued_requests": self.max_queued_requests,
                "entry_subscriptions": self.client.bus.num_subscriptions, "entry_rss_bytes": resident_bytes()}

    def check_payload(self, gen_req: GenerateRequest) -> None:
        """ApiError unless `gen_req` encodes for the bus: 400 if it cannot, 413 beyond NATS max_payload."""
        try:
            size = len(encode(gen_req))
        except (OverflowError, UnicodeEncodeError, ValueError, TypeError) as exc:
            raise ApiError(f"the request cannot be encoded: {exc}") from exc
        limit = self.client.bus.max_payload - PAYLOAD_HEADROOM
        if size > limit:
            raise ApiError(f"the request is {size} bytes encoded; the ring carries at most {limit}", 413)

    def admit(self, gen_reqs: list[GenerateRequest], traceparents: list[str | None],
              limited: bool = True, metered: bool = True) -> list[RequestStream]:
        """Take the rids of `gen_reqs` as live requests and return their (unopened) streams.

        Atomic (no await): 503 with Retry-After beyond `max_queued_requests` live requests (unless not
        `limited`) or while a critical actor is silent, 400 for a rid that is already live. `metered` streams
        feed the /metrics series (health checks are not).
        """
        if self.draining:
            self.rejected_busy_total += 1
            raise server_busy("this entry is shutting down (draining its open requests); retry on another entry")
        lost = self.liveness.blocking()
        if lost:
            self.rejected_busy_total += 1
            raise server_busy(f"the ring is not serving: it lost {self.liveness.why_lost(lost)}")
        if limited and len(self.live) + len(gen_reqs) > self.max_queued_requests:
            self.rejected_busy_total += 1
            raise server_busy(f"the server is at its limit of {self.max_queued_requests} queued requests; "
                              "retry shortly")
        rids = [gen_req.rid for gen_req in gen_reqs]
        taken = next((rid for rid in rids if rid in self.live), None)
        if taken is not None or len(set(rids)) != len(rids):
            raise ApiError(f"request id {taken or rids[0]!r} is already in use", param="rid")
        streams = [self.metrics.stream(self.client, gen_req.rid, tp, gen_req.sampling.get("lora_name"))
                   if metered else self.client.stream(gen_req.rid, tp) for gen_req, tp in zip(gen_reqs, traceparents)]
        for stream in streams:
            self.live[stream.rid] = stream
        self.admitted_total += len(streams)
        request_trace.admitted(streams, gen_reqs)  # no-op unless tracing is on
        return streams

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
        self.check_payload(gen_reqs[0])  # the choices differ only in rid and seed
        header = request.headers.get(TRACEPARENT_HEADER)
        # tracing on: the HTTP request's span (a child of the header's); off: a child traceparent of the header
        streams = self.admit(gen_reqs, [tracing.current_traceparent(header) for _ in gen_reqs])
        watch: DisconnectWatch | None = None
        try:
            await self._open_all(streams, gen_reqs)
            self._check_holders(streams)
            watch = DisconnectWatch(request)
            firsts = await asyncio.gather(*(watch.next(stream) for stream in streams))
        except BaseException:
            await self.release_all(streams)
            raise
        finally:
            if watch is not None:
                watch.close()
        request_trace.started(streams)
        error = next((first.error for first in firsts if first.error is not None), None)
        if error is not None:
            await self.release_all(streams)
            raise error
        return list(zip(streams, firsts))

    def _check_holders(self, streams: list[RequestStream]) -> None:
        """ApiError 503 if a request was taken by a replica or a detokenizer already lost (a tokenizer's view of
        the live ones lags by up to a heartbeat or two): its loss was handled before it came, so end it now."""
        for stream in streams:
            for role, rank in (("scheduler", stream.replica), ("detokenizer", stream.detokenizer)):
                if self.liveness.is_lost(role, rank):
                    raise ApiError(f"the ring lost the {role} that took the request "
                                   f"({self.liveness.why_lost([f'{role}{rank}'])})", 503, type="server_error")

    async def _open_all(self, streams: list[RequestStream], gen_reqs: list[GenerateRequest]) -> None:
        """Submit every request; the first failure as an ApiError 503 (each failed one is already aborted)."""
        results = await asyncio.gather(*(self.client.open(stream, gen_req)
                                         for stream, gen_req in zip(streams, gen_reqs)), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if isinstance(failure, RingUnavailable):
            raise ApiError(str(failure), 503, type="server_error") from failure
        if isinstance(failure, Exception):
            log.warning("submission failed: %r", failure)
            raise ApiError(f"the request could not be submitted: {failure!r}", 503, type="server_error") from failure
        if failure is not None:
            raise failure

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
        """Forget the rid (counting its terminal event once); abort the request if it is still running."""
        request_trace.released(stream)
        if self.live.get(stream.rid) is stream:
            del self.live[stream.rid]
            self.terminal_total += 1
            terminal = stream.terminal
            self.terminal_by_kind["aborted" if terminal is None else "error" if terminal.error else "finish"] += 1
        try:
            await stream.abort("client disconnected")
        except Exception as exc:  # the bus is gone: the rid is forgotten all the same
            log.warning("could not abort %s: %r", stream.rid, exc)

    async def release_all(self, streams: list[RequestStream]) -> None:
        """`release` each stream, even while the caller is being cancelled."""
        with anyio.CancelScope(shield=True):
            for stream in streams:
                await self.release(stream)

    async def fail_held(self, lost: dict[str, set[int]], message: str) -> None:
        """End the in-flight requests held by lost actors (`{"scheduler": {1}, "detokenizer": {0}}`: scheduler
        replicas, detokenizers) with a 503 error, and abort them; the others go on."""
        error = ApiError(message, 503, type="server_error")
        replicas, detokenizers = lost.get("scheduler", set()), lost.get("detokenizer", set())
        for stream in [s for s in self.live.values() if s.replica in replicas or s.detokenizer in detokenizers]:
            try:
                await stream.fail(error, "replica lost" if stream.replica in replicas else "detokenizer lost")
            except Exception:
                log.exception("failing %s failed", stream.rid)

    async def fail_all(self, message: str, reason: str = "entry shutdown") -> None:
        """End every in-flight request with a 503 error instead of leaving its client waiting, and abort it."""
        await self.fail_rids(set(self.live), message, reason)

    async def fail_rids(self, rids: set[str], message: str, reason: str) -> None:
        """`fail_all` for the in-flight requests among `rids`."""
        error = ApiError(message, 503, type="server_error")
        for stream in [s for rid, s in list(self.live.items()) if rid in rids]:
            try:
                await stream.fail(error, reason)
            except Exception:
                log.exception("failing %s failed", stream.rid)

    async def scheduler_infos(self) -> list[SchedulerInfo]:
        """Every live scheduler replica's load report, by replica id; ApiError 503 if none answers."""
        try:
            return await self.client.infos(len(self.liveness.replicas_to_ask()), self.info_timeout)
        except asyncio.TimeoutError as exc:
            raise ApiError(str(exc), 503, type="server_error") from exc

    async def scheduler_info(self) -> SchedulerInfo:
        """The scheduler's load report (with several replicas: the first one's settings, their load summed)."""
        return combined_info(await self.scheduler_infos())

    async def require_adapter(self, lora_name: str | None, model: Any) -> None:
        """OpenAI's 404 for a body whose `model` named (`adapter_of`) a LoRA adapter no replica serves."""
        if lora_name is not None and lora_name not in (await self.scheduler_info()).lora_adapters:
            raise model_not_found(model, self.served_model)

    async def command(self, command: str | ControlCommand, timeout: float | None = None) -> ControlReply:
        """Send an operator command ("flush_cache", "abort_all", "pause", "continue", or a whole ControlCommand)
        to every live scheduler replica; one reply, ok when every replica's is (bus/replica_replies.py).
        ApiError 503 if none answers within `timeout` (default `control_timeout`) seconds."""
        try:
            return await self.client.command(command, timeout or self.control_timeout,
                                             expected=len(self.liveness.replicas_to_ask()))
        except asyncio.TimeoutError as exc:
            raise ApiError(str(exc), 503, type="server_error") from exc

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
            await self.client.abort(each, OPERATOR_ABORT)
        return rids

    async def health_generate(self) -> None:
        """Generate one greedy token through the whole ring; ApiError 503 unless it arrives in `health_timeout` s."""
        gen_req = GenerateRequest(rid=f"health_generate-{new_rid()}", text="hi",
                                  sampling={"max_new_tokens": 1, "temperature": 0})
        [stream] = self.admit([gen_req], [None], limited=False, metered=False)

        async def first_output() -> RequestOutput:
            await self.client.open(stream, gen_req)
            return await stream.next()

        try:
            out = await asyncio.wait_for(first_output(), self.health_timeout)
        except asyncio.TimeoutError as exc:
            raise ApiError(f"no generated token within {self.health_timeout:g}s", 503, type="server_error") from exc
        except RingUnavailable as exc:
            raise ApiError(str(exc), 503, type="server_error") from exc
        finally:
            await self.release_all([stream])
        if out.error is not None:
            raise ApiError(f"the health check generation failed: {out.error.message}", 503, type="server_error")
