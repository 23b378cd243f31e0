"""Detokenizer actor: `{ns}.tokens.{id}` -> incremental decode -> `{ns}.out.{rid}`.

Each request's rows come to the one detokenizer the tokenizer chose for it among the live ones
(`placement.py`); its id is the `rank` of its heartbeat. Owns one `IncrementalDecoder` per live rid it serves, created from the first row of a request (which
carries the request's DecodeParams) and deleted on the row that finishes it, so every end path (finish,
abort, error) frees the state. Stop strings are decided by the scheduler; the decoder trims the one it is told.
With a reasoning plan in the DecodeParams, the decoder also splits the text into the thinking
(`RequestOutput.reasoning_text`) and the answer (`text`): `reasoning_split.py`.

A lost step message must not shorten a text silently or leave its stream waiting: a row's tokens start at
output index `completion_tokens - len(token_ids)`, so a row that does not start where the request's tokens so
far end, and a row of a request whose first row (with its DecodeParams) never came, end that request at once
with a 503 error. Its later rows are dropped (a bounded memory of such rids).

A request whose last rows never come must not hold state here forever, but a slow scheduler (a long prefill, a
busy host) is no reason to give up on one: state is dropped only on evidence (`loss_evidence.py`). A gap in the
scheduler's numbered step messages puts that incarnation's held requests in doubt; one that then gets no row
for `SUSPECT_SECONDS` ends with a 503. A restarted replica (a new epoch) drops its old incarnation's requests at
once. The requester's abort (published whenever it ends a stream itself) drops a request that gets no row for
`ABORT_GRACE_SECONDS`; rows of it that come later (a slow scheduler's final abort row) are dropped silently,
since no one waits for them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from ringserve.actors.common.model_source import resolve_model
from ringserve.actors.common.text_tokenizer import load_text_model
from ringserve.actors.common.runtime import ActorContext
from ringserve.actors.detokenizer import spans as detokenize_spans
from ringserve.actors.detokenizer.incremental import IncrementalDecoder
from ringserve.actors.detokenizer.loss_evidence import LossEvidence
from ringserve.actors.detokenizer.token_bytes import TokenBytes
from ringserve.bus.connection import Delivery
from ringserve.bus.errors import server_error
from ringserve.bus.messages import AbortRequest, BatchTokenOutput, RequestOutput, TokenLogprob, TokenRow, TopLogprob
from ringserve.observability.logging import log_event

log = logging.getLogger("detokenizer")
MAX_BROKEN_RIDS = 10_000
ABORT_GRACE_SECONDS = 5.0  # an aborted request with no row for this long: forget it (its requester has)


class DetokenizerActor:
    """Turns each scheduler step's token rows into per-request text deltas."""

    def __init__(self, ctx: ActorContext, model: str, shard: int) -> None:
        """`shard`: this detokenizer's id (it serves `{ns}.tokens.{shard}`)."""
        self._ctx = ctx
        self._shard = shard
        self._tokenizer = load_text_model(resolve_model(model)).tokenizer
        self._token_bytes = TokenBytes(self._tokenizer)  # logprobs' raw token bytes
        self._decoders: dict[str, IncrementalDecoder] = {}
        self._next_seq: dict[str, int] = {}  # per live rid: the seq of its next output
        self._received: dict[str, int] = {}  # per live rid: output tokens decoded so far
        self._broken: OrderedDict[str, None] = OrderedDict()  # rids ended for lost rows: drop what still comes
        self._spans = detokenize_spans.create()  # no-ops unless tracing is on
        self._aborted: dict[str, float] = {}  # rid -> when to forget it, unless a row comes first
        self._abandoned: OrderedDict[str, None] = OrderedDict()  # forgotten after their abort: drop late rows
        self._evidence = LossEvidence()
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> dict[str, Any]:
        self._ctx.live_rids = lambda: len(self._held())
        subject = self._ctx.subjects.tokens(self._shard)
        await self._ctx.bus.subscribe(subject, BatchTokenOutput, self._on_batch, queue=f"detokenizer-{self._shard}")
        for aborts in (self._ctx.subjects.abort_any, self._ctx.subjects.client_abort_any):
            await self._ctx.bus.subscribe(aborts, AbortRequest, self._on_abort)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_aborted())
        self._ctx.on_stop.append(self._close_spans)
        return {"shard": self._shard}

    async def _close_spans(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._spans.close_all("the detokenizer stopped")

    def _held(self) -> set[str]:
        """The rids this detokenizer holds state for."""
        return self._decoders.keys() | self._next_seq.keys() | self._received.keys()

    def _holds(self, rid: str) -> bool:
        return rid in self._decoders or rid in self._next_seq or rid in self._received

    async def _on_abort(self, abort: AbortRequest, delivery: Delivery) -> None:
        if self._holds(abort.rid):
            self._aborted[abort.rid] = time.monotonic() + ABORT_GRACE_SECONDS

    async def _sweep_aborted(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for rid, deadline in list(self._aborted.items()):
                if now >= deadline:
                    del self._aborted[rid]
                    if self._holds(rid):
                        log_event(log, logging.INFO, "an aborted request got no final row; forgetting it", rid=rid)
                        self._drop(rid, "aborted")
                        _remember(self._abandoned, rid)
            for rid in self._evidence.overdue(now, self._held()):
                log_event(log, logging.ERROR, "a request's last rows were lost on the bus; ending it", rid=rid)
                seq = self._next_seq.get(rid, 0)
                self._drop(rid, "its last rows were lost")
                _remember(self._broken, rid)
                await self._ctx.bus.publish(self._ctx.subjects.output(rid), RequestOutput(
                    rid=rid, seq=seq, error=server_error("the end of the output was lost in transit; retry", 503)))

    def _drop(self, rid: str, why: str) -> None:
        """Forget everything held for `rid`, with its span."""
        self._forget(rid)
        self._next_seq.pop(rid, None)
        self._evidence.forget(rid)
        self._spans.close(rid, why)

    async def _on_batch(self, batch: BatchTokenOutput, delivery: Delivery) -> None:
        for rid in self._evidence.on_message(batch, time.monotonic()):
            if self._holds(rid):  # its replica was restarted: the entry has ended it; no row of it will come
                self._drop(rid, "its scheduler was restarted")
        for row in batch.rows:
            self._evidence.on_row(row.rid, batch)
            if row.rid in self._aborted:  # rows still come: the scheduler ends it (or already has)
                self._aborted[row.rid] = time.monotonic() + ABORT_GRACE_SECONDS
            traceparent = self._spans.begin(row) or delivery.traceparent
            try:
                output = self._decode_row(row)
            except Exception as exc:  # one request's failure must not drop the other rows of the step
                log.exception("detokenizing %s failed", row.rid)
                self._decoders.pop(row.rid, None)
                output = RequestOutput(rid=row.rid, error=server_error(f"detokenizing the output failed: {exc!r}"))
            if output is not None:
                output.seq = self._next_seq.pop(row.rid, 0)
                if not output.is_last:
                    self._next_seq[row.rid] = output.seq + 1
                await self._ctx.bus.publish(self._ctx.subjects.output(row.rid), output, traceparent)
            if not self._holds(row.rid):
                self._evidence.forget(row.rid)
            self._spans.after(row, output)

    def _decode_row(self, row: TokenRow) -> RequestOutput | None:
        if row.rid in self._broken:
            return None
        if row.rid in self._abandoned:
            if row.decode is None:  # a late row of a request its requester ended: no one waits for it
                return None
            del self._abandoned[row.rid]  # the rid again, as a new request
        lost = self._lost_tokens(row)
        if lost is not None:
            self._forget(row.rid)
            _remember(self._broken, row.rid)
            log_event(log, logging.ERROR, "rows of a request were lost on the bus; ending it", rid=row.rid,
                      detail=lost)
            return RequestOutput(rid=row.rid, prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens,
                                 error=server_error(f"part of the output was lost in transit ({lost}); retry", 503))
        if row.finish is None:
            self._received[row.rid] = row.completion_tokens
        else:
            self._received.pop(row.rid, None)
        if row.finish is not None and row.finish.type == "error":
            self._decoders.pop(row.rid, None)
            return RequestOutput(rid=row.rid, prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens,
                                 error=row.finish.error or server_error("generation failed"))
        decoder = self._decoders.get(row.rid)
        if decoder is None:
            if row.decode is None:
                # finished before its first row (an abort while it waited): nothing to decode; the rows it
                # may have had are ruled out by `_lost_tokens`
                return RequestOutput(rid=row.rid, prompt_tokens=row.prompt_tokens,
                                     completion_tokens=row.completion_tokens, cached_tokens=row.cached_tokens,
                                     spec_drafted_tokens=row.spec_drafted_tokens,
                                     spec_accepted_tokens=row.spec_accepted_tokens,
                                     finish=row.finish, queue_time=row.queue_time)
            decoder = self._decoders[row.rid] = IncrementalDecoder(self._tokenizer, row.decode)
        reasoning, text = decoder.feed_split(row.token_ids, row.finish)
        if row.finish is not None:
            del self._decoders[row.rid]
        scored_ids = row.prompt_ids[len(row.prompt_ids) - len(row.prompt_logprobs):]  # the scored tail
        return RequestOutput(rid=row.rid, text=text, reasoning_text=reasoning, token_ids=row.token_ids,
                             prompt_tokens=row.prompt_tokens,
                             completion_tokens=row.completion_tokens, cached_tokens=row.cached_tokens,
                                     spec_drafted_tokens=row.spec_drafted_tokens,
                                     spec_accepted_tokens=row.spec_accepted_tokens,
                             finish=row.finish, queue_time=row.queue_time,
                             logprobs=self._logprobs(row.token_ids, row.logprobs, row.top_ids, row.top_logprobs),
                             prompt_logprobs=self._logprobs(scored_ids, row.prompt_logprobs, row.prompt_top_ids,
                                                            row.prompt_top_logprobs, row.prompt_ranks),
                             prompt_token_ids=row.prompt_ids, embedding=row.embedding)

    def _logprobs(self, token_ids: list[int], logprobs: list[float | None], top_ids: list[list[int]],
                  top_logprobs: list[list[float]], ranks: list[int] | None = None) -> list[TokenLogprob]:
        """Tokens' logprobs with each token's text (one decode per token: only rows that asked pay for it)."""
        if not logprobs:
            return []
        text, raw = self._token_text, self._token_bytes

        def top(token_id: int, logprob: float) -> TopLogprob:
            token = text(token_id)
            return TopLogprob(token_id, token, logprob, bytes=raw(token_id, token))

        out = []
        for k, (t, lp, ids, values) in enumerate(zip(token_ids, logprobs, top_ids, top_logprobs)):
            token = text(t)
            rank = (ranks[k] or None) if ranks else None  # 0: the prompt's first token, which has no rank
            out.append(TokenLogprob(token_id=t, token=token, logprob=lp, top=[top(i, v) for i, v in zip(ids, values)],
                                    bytes=raw(t, token), rank=rank))
        return out

    def _lost_tokens(self, row: TokenRow) -> str | None:
        """What is missing before `row`, or None when it follows on from the request's last row."""
        start = row.completion_tokens - len(row.token_ids)
        received = self._received.get(row.rid)
        if received is None:  # the request's first row here
            if row.decode is None and (row.finish is None or row.completion_tokens > 0):
                return "its first row never arrived"
            received = 0
        if start != received:
            return f"tokens {received}..{start - 1} of its output never arrived"
        return None

    def _forget(self, rid: str) -> None:
        """Drop a request's decode state (its output seq goes with the error output, in `_on_batch`)."""
        self._decoders.pop(rid, None)
        self._received.pop(rid, None)

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])


def _remember(memory: OrderedDict[str, None], rid: str) -> None:
    """Add `rid` to a bounded memory of rids (the oldest go first)."""
    memory[rid] = None
    memory.move_to_end(rid)
    while len(memory) > MAX_BROKEN_RIDS:
        memory.popitem(last=False)


async def detokenizer_main(ctx: ActorContext, model: str, shard: int) -> dict[str, Any]:
    """Entry point for the runtime: build the actor and subscribe."""
    return await DetokenizerActor(ctx, model, shard).start()
