"""The JetStream stream that buffers finished spans (`--trace-buffer jetstream`), and how to read it.

Stream `{ns}-spans` captures `{ns}.spans.>` (one subject per role) on file storage, limits retention (spans
stay for `ringserve trace` after the trace exporter forwarded them, until `max_age` or `max_bytes`), with a
duplicate window so a publish retried under the same `Nats-Msg-Id` is stored once. The trace exporter reads
it through one durable pull consumer (`FORWARD_CONSUMER`, explicit acks): a message is acked only after the
collector accepted it, so it survives a collector outage and the exporter's restart.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from nats.js.api import (
    AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig,
)
from nats.js.errors import BadRequestError

from ringserve.bus.subjects import Subjects

FORWARD_CONSUMER = "forward-otlp"
DEFAULT_MAX_AGE_S = 24 * 3600.0
DEFAULT_MAX_BYTES = 1 << 30
DUPLICATE_WINDOW_S = 120.0
ACK_WAIT_S = 60.0  # longer than a forward's worst case (collector timeout), so nothing is redelivered mid-flight


def span_stream_config(subjects: Subjects, max_age_s: float = DEFAULT_MAX_AGE_S,
                       max_bytes: int = DEFAULT_MAX_BYTES) -> StreamConfig:
    """The stream's configuration."""
    return StreamConfig(name=subjects.span_stream(), subjects=[subjects.spans_filter()],
                        retention=RetentionPolicy.LIMITS, storage=StorageType.FILE, max_age=max_age_s,
                        max_bytes=max_bytes, discard=DiscardPolicy.OLD, duplicate_window=DUPLICATE_WINDOW_S,
                        description="ringserve finished spans (OTLP protobuf ExportTraceServiceRequest)")


async def ensure_span_stream(js: Any, subjects: Subjects, max_age_s: float = DEFAULT_MAX_AGE_S,
                             max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """Create the span stream, or bring an existing one (e.g. from a kept `--trace-store`) to this config."""
    config = span_stream_config(subjects, max_age_s, max_bytes)
    try:
        await js.add_stream(config)
    except BadRequestError:  # exists with another configuration
        await js.update_stream(config)


async def forward_subscription(js: Any, subjects: Subjects, max_ack_pending: int = 4096) -> Any:
    """The trace exporter's pull subscription on the durable consumer (created on first use, then resumed)."""
    config = ConsumerConfig(durable_name=FORWARD_CONSUMER, ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S,
                            max_deliver=-1, max_ack_pending=max_ack_pending, deliver_policy=DeliverPolicy.ALL,
                            filter_subject=subjects.spans_filter())
    return await js.pull_subscribe(subjects.spans_filter(), durable=FORWARD_CONSUMER,
                                   stream=subjects.span_stream(), config=config)


async def read_span_stream(js: Any, subjects: Subjects, batch: int = 256,
                           timeout: float = 1.0) -> AsyncIterator[bytes]:
    """Every message now in the span stream, oldest first, through a short-lived consumer that acks nothing
    (the trace exporter's progress is untouched)."""
    info = await js.stream_info(subjects.span_stream())
    if info.state.messages == 0:
        return
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                            inactive_threshold=60.0, filter_subject=subjects.spans_filter())
    sub = await js.pull_subscribe(subjects.spans_filter(), stream=subjects.span_stream(), config=config)
    last = info.state.last_seq
    try:
        while True:
            try:
                msgs = await sub.fetch(batch, timeout=timeout)
            except asyncio.TimeoutError:
                return
            for msg in msgs:
                yield msg.data
                if msg.metadata.sequence.stream >= last:
                    return
    finally:
        try:
            await sub.unsubscribe()
            await js.delete_consumer(subjects.span_stream(), config.name)
        except Exception:  # the consumer also expires on its own (inactive_threshold)
            pass
