"""A NATS connection that speaks typed messages and always carries a W3C `traceparent` header."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus.codec import DecodeError, decode, encode
from observability.logging import log_event
from observability.traceparent import TRACEPARENT_HEADER, is_valid_traceparent, new_traceparent

T = TypeVar("T")
log = logging.getLogger("bus")


@dataclass(frozen=True)
class Delivery:
    """Where a message came from: its subject and the trace context it carried."""

    subject: str
    traceparent: str


Handler = Callable[[Any, Delivery], Awaitable[Any]]


class PayloadTooLarge(ValueError):
    """The encoded message exceeds the server's max_payload; nothing was sent."""


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
    ) -> "BusConnection":
        """Connect to `url`; `on_closed` runs if the connection is lost for good (the actor should exit)."""

        async def error_cb(exc: Exception) -> None:
            log_event(log, logging.WARNING, "nats error", client=name, error=repr(exc))

        async def closed_cb() -> None:
            if on_closed is not None:
                await on_closed()

        client = await nats.connect(
            servers=[url],
            name=name,
            error_cb=error_cb,
            closed_cb=closed_cb,
            max_reconnect_attempts=max_reconnect_attempts,
            reconnect_time_wait=0.5,
            connect_timeout=5,
            allow_reconnect=True,
        )
        return cls(client)

    async def publish(self, subject: str, msg: Any, traceparent: str | None = None) -> None:
        """Encode and publish `msg` with a traceparent header (a fresh trace if none is given).

        Raises PayloadTooLarge when the encoded message exceeds the server's max_payload.
        """
        headers = {TRACEPARENT_HEADER: traceparent if is_valid_traceparent(traceparent) else new_traceparent()}
        data = encode(msg)
        try:
            await self.client.publish(subject, data, headers=headers)
        except nats.errors.MaxPayloadError as exc:
            raise PayloadTooLarge(f"{type(msg).__name__} of {len(data)} bytes exceeds max_payload "
                                  f"{self.max_payload} on {subject}") from exc

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
        self, subject: str, msg_type: type[T], handler: Handler, queue: str = ""
    ) -> Subscription:
        """Deliver each decoded `msg_type` on `subject` to `handler(msg, delivery)`, in arrival order.

        If the message was a request and the handler returns a message, it is sent as the reply.
        Undecodable payloads are logged and dropped; a failing handler is logged and does not stop delivery.
        """

        async def on_msg(raw: Msg) -> None:
            tp = (raw.headers or {}).get(TRACEPARENT_HEADER)
            delivery = Delivery(raw.subject, tp if is_valid_traceparent(tp) else new_traceparent())
            try:
                msg = decode(raw.data, msg_type)
            except DecodeError as exc:
                log_event(log, logging.WARNING, "dropped undecodable message", subject=raw.subject, error=str(exc))
                return
            try:
                reply = await handler(msg, delivery)
            except Exception:
                log.exception("handler failed for %s", raw.subject)
                return
            if raw.reply and reply is not None:
                await self.client.publish(raw.reply, encode(reply), headers={TRACEPARENT_HEADER: delivery.traceparent})

        return await self.client.subscribe(
            subject, queue=queue, cb=on_msg, pending_msgs_limit=1_000_000, pending_bytes_limit=512 * 1024 * 1024
        )

    async def request(
        self, subject: str, msg: Any, reply_type: type[T], timeout: float = 2.0, traceparent: str | None = None
    ) -> T:
        """Send `msg` as a request and decode the reply as `reply_type` (raises asyncio.TimeoutError)."""
        headers = {TRACEPARENT_HEADER: traceparent if is_valid_traceparent(traceparent) else new_traceparent()}
        try:
            raw = await self.client.request(subject, encode(msg), timeout=timeout, headers=headers)
        except nats.errors.TimeoutError as exc:
            raise asyncio.TimeoutError(f"no reply on {subject} within {timeout}s") from exc
        except nats.errors.NoRespondersError as exc:
            raise asyncio.TimeoutError(f"no responders on {subject}") from exc
        return decode(raw.data, reply_type)

    @property
    def max_payload(self) -> int:
        return self.client.max_payload

    async def flush(self) -> None:
        await self.client.flush()

    async def close(self) -> None:
        if not self.client.is_closed:
            await self.client.drain()
