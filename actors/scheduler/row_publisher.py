"""How the scheduler publishes its engine's token rows: one step message per detokenizer (each request's rows go to
the detokenizer stamped on its `TokenizedRequest`), joined by `--stream-interval` first (stream_interval.py),
prefill jobs' rows kept back (kv_share.py), a row too large for the bus ending its request (`SchedulerActor`'s
`rows`)."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Callable

from ringserve.actors.common.runtime import ActorContext
from ringserve.actors.engine.interface import EngineInterface
from ringserve.actors.scheduler.admission import Admission
from ringserve.actors.scheduler.kv_share import KvSharing
from ringserve.actors.scheduler.request_spans import NoSpans
from ringserve.actors.scheduler.step_messages import StepNumbering
from ringserve.actors.scheduler.stream_interval import StreamCoalescer
from ringserve.bus.errors import server_error
from ringserve.bus.messages import FinishReason, TokenRow
from ringserve.observability import tracing
from ringserve.observability.logging import log_event

log = logging.getLogger("scheduler")


class RowPublisher:
    """Publishes a scheduler's token rows to their detokenizers, and frees the admission slot of each request
    whose final row it publishes."""

    def __init__(self, ctx: ActorContext, engine: EngineInterface, admission: Admission, spans: NoSpans,
                 share: KvSharing | None, streams: StreamCoalescer, numbering: StepNumbering,
                 detokenizer_of: dict[str, int], step: Callable[[], int]) -> None:
        """`detokenizer_of`: the detokenizer stamped on each request taken and not yet ended (the scheduler adds
        them); `step`: the engine's step number now, which the step messages carry."""
        self._ctx, self._engine, self._admission, self._spans = ctx, engine, admission, spans
        self._share, self._streams, self._numbering = share, streams, numbering
        self._detokenizer_of, self._step = detokenizer_of, step

    async def publish(self, outputs: list[TokenRow], step_traceparent: str | None = None,
                      after_step: bool = False) -> None:
        """Publish rows, one message per detokenizer, or hold them for `--stream-interval` (`after_step`: a
        step's rows; `step_traceparent`: the step span they came from)."""
        now = tracing.now_ns() if tracing.enabled() and outputs else 0
        for out in outputs:
            if out.finish is not None:  # its final row (finish, abort, error): the request's slot is free
                self._admission.release(out.rid)
            if out.decode is not None:  # a request's first row
                out.traceparent = self._spans.traceparent(out.rid)
            self._spans.output(out, now)
        if self._share is not None:  # prefill jobs' rows end here (kv_share.py): nobody reads them
            outputs, ended = self._share.take_job_rows(outputs)
            for rid in ended:
                self._detokenizer_of.pop(rid, None)
        await self.send(self._streams.take(outputs, after_step), step_traceparent)

    async def send(self, outputs: list[TokenRow], step_traceparent: str | None = None) -> None:
        """Publish rows as they are, one message per detokenizer."""
        if not outputs:
            return
        by_detokenizer: dict[int, list[TokenRow]] = defaultdict(list)
        for out in outputs:
            by_detokenizer[self._detokenizer(out)].append(out)
        for detokenizer, rows in by_detokenizer.items():
            await self._publish_rows(self._ctx.subjects.tokens(detokenizer), rows, step_traceparent)
        finished = [r.rid for r in outputs if r.finish is not None]
        if finished:
            log_event(log, logging.DEBUG, "finished", rids=",".join(finished))

    def _detokenizer(self, row: TokenRow) -> int:
        """Where `row` goes: its request's stamped detokenizer (forgotten with the request's final row)."""
        if row.finish is not None:
            return self._detokenizer_of.pop(row.rid, 0)
        return self._detokenizer_of.get(row.rid, 0)

    async def _publish_rows(self, subject: str, rows: list[TokenRow], traceparent: str | None = None) -> None:
        """One step message (split while it exceeds max_payload); a row too large alone ends its request."""
        step = self._step()
        too_large = await self._numbering.publish(self._ctx.bus, subject, step, rows, traceparent)
        for row in too_large:
            log_event(log, logging.ERROR, "a token row exceeds max_payload; ending its request", rid=row.rid)
            self._engine.abort(row.rid)
            self._admission.release(row.rid)
            self._detokenizer_of.pop(row.rid, None)
            error = FinishReason(type="error", error=server_error("the request's output exceeds the bus payload limit"))
            final = TokenRow(rid=row.rid, token_ids=[], prompt_tokens=row.prompt_tokens,
                             completion_tokens=row.completion_tokens, finish=error)
            self._spans.output(final, tracing.now_ns())
            await self._numbering.publish(self._ctx.bus, subject, step, [final])
