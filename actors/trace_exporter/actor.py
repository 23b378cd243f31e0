"""Trace exporter actor: the span stream `{ns}-spans` -> the OTLP collector, acking only what it accepted.

On start it creates (or adopts) the span stream and its durable pull consumer (bus/span_stream.py), so the
launcher starts it before any other actor: the stream exists before the first span is published. Then it
loops: fetch up to `BATCH` messages, post them as one OTLP request (the messages are serialized
`ExportTraceServiceRequest`s, and concatenated protobuf messages merge), ack every message once the collector
answered 2xx, else nak them with a growing delay and wait. A collector outage or restart therefore loses
nothing: the spans wait in JetStream (on disk) and go out once it is back. A request the collector refuses
as malformed (HTTP 400) is retried message by message, and a message refused alone is dropped (logged).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from ringserve.actors.common.runtime import ActorContext
from ringserve.bus.span_stream import ensure_span_stream, forward_subscription
from ringserve.observability.logging import log_event
from ringserve.observability.otlp_forward import OtlpForwarder
from ringserve.observability.tracing_config import TracingConfig, config_from_args

log = logging.getLogger("trace_exporter")
BATCH = 256
FETCH_TIMEOUT_S = 1.0
FIRST_BACKOFF_S = 0.25


class TraceExporterActor:
    """Owns the durable consumer and forwards what it fetches."""

    def __init__(self, ctx: ActorContext, config: TracingConfig, max_age_s: float, max_bytes: int,
                 max_backoff_s: float) -> None:
        self._ctx = ctx
        self._config = config
        self._max_age_s = max_age_s
        self._max_bytes = max_bytes
        self._max_backoff_s = max_backoff_s
        self._forwarder = OtlpForwarder(config)
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._backoff = FIRST_BACKOFF_S
        self._down = False  # the collector refused the last try (logged once per outage)
        self.forwarded = 0  # messages the collector accepted

    async def start(self) -> dict[str, Any]:
        js = self._ctx.bus.client.jetstream()
        await ensure_span_stream(js, self._ctx.subjects, self._max_age_s, self._max_bytes)
        self._sub = await forward_subscription(js, self._ctx.subjects)
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._ctx.on_stop.append(self._stop)
        log_event(log, logging.INFO, "forwarding spans", stream=self._ctx.subjects.span_stream(),
                  collector=self._config.traces_url, protocol=self._config.protocol)
        return {"stream": self._ctx.subjects.span_stream(), "collector": self._config.traces_url}

    async def _stop(self) -> None:
        """Let the batch in flight finish (acked or nakked), then stop."""
        if self._task is not None:
            await asyncio.wait_for(self._task, timeout=self._forwarder.timeout + 2 * FETCH_TIMEOUT_S)
        if self._sub is not None:  # a pull subscription left open stalls the connection's drain
            await self._sub.unsubscribe()
        log_event(log, logging.INFO, "stopped forwarding", forwarded_messages=self.forwarded)

    async def _run(self) -> None:
        while not self._ctx.stopping.is_set():
            try:
                msgs = await self._sub.fetch(BATCH, timeout=FETCH_TIMEOUT_S)
            except asyncio.TimeoutError:
                continue
            except Exception as exc:  # disconnected or the server is restarting: try again shortly
                log_event(log, logging.WARNING, "fetching spans failed", error=repr(exc))
                await self._pause(1.0)
                continue
            try:
                await self._forward(msgs)
            except Exception:  # a failed ack or nak: the messages come back after the consumer's ack wait
                log.exception("forwarding a batch failed")
                await self._pause(1.0)

    async def _forward(self, msgs: list[Any]) -> None:
        result = await asyncio.to_thread(self._forwarder.send, b"".join(m.data for m in msgs))
        if result.drop and len(msgs) > 1:  # find the message the collector refuses; send the others
            for msg in msgs:
                await self._forward([msg])
            return
        if result.accepted or result.drop:
            if result.drop:
                log_event(log, logging.ERROR, "the collector refused a span batch as malformed; dropped it",
                          detail=result.detail)
            for msg in msgs:
                await msg.ack()
            await self._ctx.bus.flush()
            self.forwarded += len(msgs)
            if self._down:
                log_event(log, logging.INFO, "collector reachable again", collector=self._config.traces_url)
            self._down = False
            self._backoff = FIRST_BACKOFF_S
            return
        if not self._down:
            log_event(log, logging.WARNING, "collector unavailable; spans wait in JetStream",
                      collector=self._config.traces_url, detail=result.detail)
        self._down = True
        for msg in msgs:
            await msg.nak(delay=self._backoff)
        await self._pause(self._backoff)
        self._backoff = min(self._backoff * 2, self._max_backoff_s)

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._ctx.stopping.wait(), seconds)
        except asyncio.TimeoutError:
            pass


async def trace_exporter_main(ctx: ActorContext, args: argparse.Namespace) -> dict[str, Any]:
    """Entry point for the runtime: adopt the stream and consumer, start forwarding."""
    config = config_from_args(args)
    actor = TraceExporterActor(ctx, config, args.span_max_age, args.span_max_bytes, args.max_backoff)
    return await actor.start()
