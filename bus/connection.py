"""A NATS connection that speaks typed messages and always carries a W3C `traceparent` header.

With tracing on (observability/tracing.py), publishes and requests are `send <template>` spans and deliveries
`process <template>` spans (observability/messaging.py) whose context the header carries, except on the
high-rate subjects in UNTRACED (per-token outputs, heartbeats, span batches), which only carry the context.
Off, the header is propagated as it is given (or a fresh trace), and no span code runs.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ringserve.bus.codec import DecodeError, decode, encode, encode_json, is_json
from ringserve.bus.credentials import NatsCredentials
from ringserve.bus.subjects import subject_template
from ringserve.observability import messaging, tracing
from ringserve.observability.logging import log_event
from ringserve.observability.traceparent import TRACEPARENT_HEADER, is_valid_traceparent, new_traceparent

T = TypeVar("T")
INBOX_ROOT = "_INBOX."  # every reply inbox is under it (bus/permissions.py gives each role and client its own)
log = logging.getLogger("bus")
# Subject templates whose messages get no span of their own (their header still carries the context): one
# message per token per request, liveness chatter, and the spans themselves.
_HEADER_BYTES = len("NATS/1.0\r\n\r\n") + len(TRACEPARENT_HEADER) + len(": \r\n") + len(new_traceparent())
UNTRACED = frozenset({"out.{rid}", "client.{client}.out.{rid}", "control.heartbeat", "control.ready",
                      "control.scheduler.info", "spans.{role}", "_INBOX", "$JS", "(other)"})


@dataclass(frozen=True)
class Delivery:
    """Where a message came from: its subject and the trace context it carried."""

    subject: str
    traceparent: str


Handler = Callable[[Any, Delivery], Awaitable[Any]]
# called with the raw payload and the reason when a message does not decode; may return a reply, as a Handler
MalformedHandler = Callable[[bytes, DecodeError, Delivery], Awaitable[Any]]


class PayloadTooLarge(ValueError):
    """The encoded message exceeds the server's max_payload; nothing was sent."""


PING_INTERVAL = 1.0  # seconds between client pings
MAX_OUTSTANDING_PINGS = 2
# A hung node still accepts TCP connections (the kernel does) but never says INFO: each reconnect attempt to it
# waits this long before the client tries another node, and nats-py shuffles the pool on every reconnect, so it
# may pick the hung node again. nats-py's default (2 s) is kept explicit: a handshake on a LAN takes milliseconds.
CONNECT_TIMEOUT = 2.0


class BusConnection:
    """Typed publish/subscribe/request over one nats-py client."""

    def __init__(self, client: Client) -> None:
        self.client = client

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        on_closed: Callable[[], Awaitable[None]] | None = None,
        max_reconnect_attempts: int = 60,
        credentials: NatsCredentials | None = None,
        inbox_prefix: str | None = None,
    ) -> "BusConnection":
        """Connect to `url` (a comma-separated list of a cluster's nodes); `on_closed` runs if the connection is lost for good (the actor should exit).

        `credentials`: user/password, .creds file and TLS (None: unauthenticated). `inbox_prefix`: where this
        connection's request replies arrive (bus/permissions.py gives each role its own; default `_INBOX`).
        """

        async def error_cb(exc: Exception) -> None:
            log_event(log, logging.WARNING, "nats error", client=name, error=repr(exc))

        async def closed_cb() -> None:
            if on_closed is not None:
                await on_closed()

        client = await nats.connect(
            servers=[u.strip() for u in url.split(",") if u.strip()],  # a cluster: any of its nodes
            name=name,
            # A hung node answers no pings: after PING_INTERVAL * (MAX_OUTSTANDING_PINGS + 1) s (3 s) the client
            # drops it and reconnects to another node (nats-py's defaults take minutes).
            ping_interval=PING_INTERVAL,
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            error_cb=error_cb,
            closed_cb=closed_cb,
            max_reconnect_attempts=max_reconnect_attempts,
            reconnect_time_wait=0.5,
            connect_timeout=CONNECT_TIMEOUT,
            allow_reconnect=True,
            inbox_prefix=inbox_prefix or "_INBOX",
            **(credentials.connect_options() if credentials is not None else {}),
        )
        return cls(client)

    async def publish(self, subject: str, msg: Any, traceparent: str | None = None) -> None:
        """Encode and publish `msg` with a traceparent header (a fresh trace if none is given).

        Raises PayloadTooLarge when the encoded message exceeds the server's max_payload.
        """
        data = encode(msg)
        # the server counts the headers against max_payload too (and drops the connection), nats-py only the data
        if len(data) + _HEADER_BYTES > self.max_payload:
            raise PayloadTooLarge(f"{type(msg).__name__} of {len(data)} bytes exceeds max_payload "
                                  f"{self.max_payload} on {subject}")
        template = subject_template(subject) if tracing.enabled() else ""
        if template and template not in UNTRACED:
            with messaging.send(subject, template, traceparent, len(data)) as headers:
                await self.client.publish(subject, data, headers=headers)
            return
        await self.client.publish(subject, data, headers={TRACEPARENT_HEADER: _header(traceparent)})

    async def publish_split(self, subject: str, items: list[T], build: Callable[[list[T]], Any],
                            traceparent: str | None = None) -> list[T]:
        """Publish `build(items)`, split into halves (recursively) while a message exceeds max_payload.

        Returns the items that exceed the limit even alone; they were not sent.
        """
        try:
            await self.publish(subject, build(items), traceparent)
            return []
        except PayloadTooLarge:
            if len(items) <= 1:
                return list(items)
        half = len(items) // 2
        return (await self.publish_split(subject, items[:half], build, traceparent)
                + await self.publish_split(subject, items[half:], build, traceparent))

    async def subscribe(
        self, subject: str, msg_type: type[T], handler: Handler, queue: str = "",
        reply_inbox: Callable[[str], str] | None = None, on_malformed: MalformedHandler | None = None,
    ) -> Subscription:
        """Deliver each decoded `msg_type` on `subject` to `handler(msg, delivery)`, in arrival order.

        If the message was a request and the handler returns a message, it is sent as the reply, but only to
        the requester's own inbox (encoded as the request was: msgpack, or JSON for a JSON request): a reply
        subject outside `reply_inbox(message subject)` (default: anything
        under `_INBOX.`) is refused, so a sender cannot make this actor publish where it chose (a stream's API,
        another client's outputs). Undecodable payloads are logged and go to `on_malformed` (dropped without
        it); a failing handler is logged and does not stop delivery.
        """

        async def dispatch(raw: Msg, delivery: Delivery) -> None:
            try:
                msg = decode(raw.data, msg_type)
            except DecodeError as exc:
                log_event(log, logging.WARNING, "undecodable message", subject=raw.subject, error=str(exc)[:500])
                messaging.mark_failed(f"undecodable message: {exc}")
                if on_malformed is None:
                    return
                answer = on_malformed(raw.data, exc, delivery)
            else:
                answer = handler(msg, delivery)
            try:
                reply = await answer
            except Exception as exc:
                log.exception("handler failed for %s", raw.subject)
                messaging.mark_failed(f"handler failed: {exc!r}", exc)
                return
            if raw.reply and reply is not None:
                inbox = reply_inbox(raw.subject) if reply_inbox is not None else INBOX_ROOT
                if not raw.reply.startswith(inbox):
                    log_event(log, logging.WARNING, "refused a reply outside the requester's inbox",
                              subject=raw.subject, reply=raw.reply[:200], inbox=inbox)
                    return
                payload = encode_json(reply) if is_json(raw.data) else encode(reply)  # answer in the request's encoding
                await self.client.publish(raw.reply, payload, headers={TRACEPARENT_HEADER: delivery.traceparent})

        async def on_msg(raw: Msg) -> None:
            tp = (raw.headers or {}).get(TRACEPARENT_HEADER)
            template = subject_template(raw.subject) if tracing.enabled() else ""
            if template and template not in UNTRACED:
                sender = tp if is_valid_traceparent(tp) else None
                with messaging.process(raw.subject, template, sender, len(raw.data), queue) as own:
                    await dispatch(raw, Delivery(raw.subject, own))
                return
            await dispatch(raw, Delivery(raw.subject, tp if is_valid_traceparent(tp) else new_traceparent()))

        return await self.client.subscribe(
            subject, queue=queue, cb=on_msg, pending_msgs_limit=1_000_000, pending_bytes_limit=512 * 1024 * 1024
        )

    async def request(
        self, subject: str, msg: Any, reply_type: type[T], timeout: float = 2.0, traceparent: str | None = None
    ) -> T:
        """Send `msg` as a request and decode the reply as `reply_type` (raises asyncio.TimeoutError)."""
        data = encode(msg)
        template = subject_template(subject) if tracing.enabled() else ""
        if template and template not in UNTRACED:
            with messaging.send(subject, template, traceparent, len(data), request=True) as headers:
                return decode(await self._request(subject, data, timeout, headers), reply_type)
        return decode(await self._request(subject, data, timeout, {TRACEPARENT_HEADER: _header(traceparent)}),
                      reply_type)

    async def gather(self, subject: str, msg: Any, reply_type: type[T], expected: int, timeout: float = 2.0,
                     traceparent: str | None = None) -> list[T]:
        """Send `msg` as a request every subscriber of `subject` answers (the scheduler replicas), and collect
        the replies: `expected` of them, or as many as came within `timeout` seconds (undecodable ones
        skipped)."""
        inbox = self.client.new_inbox()
        sub = await self.client.subscribe(inbox)
        replies: list[T] = []
        try:
            await self.client.publish(subject, encode(msg), reply=inbox,
                                      headers={TRACEPARENT_HEADER: _header(traceparent)})
            deadline = asyncio.get_running_loop().time() + timeout
            while len(replies) < expected:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    raw = await sub.next_msg(timeout=left)
                except nats.errors.TimeoutError:
                    break
                try:
                    replies.append(decode(raw.data, reply_type))
                except DecodeError:
                    log_event(log, logging.WARNING, "undecodable reply skipped", subject=subject)
        finally:
            await sub.unsubscribe()
        return replies

    async def _request(self, subject: str, data: bytes, timeout: float, headers: dict[str, str]) -> bytes:
        try:
            raw = await self.client.request(subject, data, timeout=timeout, headers=headers)
        except nats.errors.TimeoutError as exc:
            raise asyncio.TimeoutError(f"no reply on {subject} within {timeout}s") from exc
        except nats.errors.NoRespondersError as exc:
            raise asyncio.TimeoutError(f"no responders on {subject}") from exc
        return raw.data

    @property
    def max_payload(self) -> int:
        return self.client.max_payload

    @property
    def num_subscriptions(self) -> int:
        """Subscriptions open on this connection (per-request ones must not pile up)."""
        return len(self.client._subs)

    async def flush(self) -> None:
        await self.client.flush()

    async def close(self) -> None:
        if not self.client.is_closed:
            await self.client.drain()


def _header(traceparent: str | None) -> str:
    """The traceparent a message without a span of its own carries: the given one, else (tracing on) the active
    span's, else a fresh trace."""
    if is_valid_traceparent(traceparent):
        return traceparent  # type: ignore[return-value]
    return tracing.current_traceparent() if tracing.enabled() else new_traceparent()
