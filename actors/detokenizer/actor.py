"""Detokenizer actor: `{ns}.tokens.{shard}` -> incremental decode -> `{ns}.out.{rid}`.

Owns one `IncrementalDecoder` per live rid of its shard, created from the first row of a request (which
carries the request's SamplingParams) and deleted on the row that finishes it, so every end path (finish,
abort, error) frees the state. If a stop string shows up in the text before the scheduler reports it, the
detokenizer finishes the stream itself and asks the scheduler to abort the request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from actors.common.model_source import load_tokenizer, resolve_model
from actors.common.runtime import ActorContext
from actors.detokenizer.incremental import IncrementalDecoder
from bus.connection import Delivery
from bus.messages import AbortRequest, BatchTokenOutput, FinishReason, RequestOutput, TokenRow
from observability.logging import log_event

log = logging.getLogger("detokenizer")
CLOSED_RIDS_KEPT = 4096


class DetokenizerActor:
    """Turns each scheduler step's token rows into per-request text deltas."""

    def __init__(self, ctx: ActorContext, model: str, shard: int) -> None:
        self._ctx = ctx
        self._shard = shard
        self._tokenizer = load_tokenizer(resolve_model(model))
        self._decoders: dict[str, IncrementalDecoder] = {}
        # rids this actor finished early on a stop string; their late rows are dropped
        self._closed: OrderedDict[str, None] = OrderedDict()

    async def start(self) -> dict[str, Any]:
        subject = self._ctx.subjects.tokens(self._shard)
        await self._ctx.bus.subscribe(subject, BatchTokenOutput, self._on_batch, queue=f"detokenizer-{self._shard}")
        return {"shard": self._shard}

    async def _on_batch(self, batch: BatchTokenOutput, delivery: Delivery) -> None:
        for row in batch.rows:
            output = self._decode_row(row)
            if output is not None:
                await self._ctx.bus.publish(self._ctx.subjects.output(row.rid), output, delivery.traceparent)
                if output.finish is not None and row.finish is None:
                    await self._ctx.bus.publish(
                        self._ctx.subjects.abort(row.rid), AbortRequest(rid=row.rid, reason="stop string"),
                        delivery.traceparent)

    def _decode_row(self, row: TokenRow) -> RequestOutput | None:
        if row.rid in self._closed:
            return None
        decoder = self._decoders.get(row.rid)
        if decoder is None:
            if row.sampling is None:
                if row.finish is None:
                    log_event(log, logging.WARNING, "tokens for an unknown request dropped", rid=row.rid)
                    return None
                # finished before its first row reached us (an abort while waiting): nothing to decode
                return RequestOutput(rid=row.rid, prompt_tokens=row.prompt_tokens,
                                     completion_tokens=row.completion_tokens, finish=row.finish)
            decoder = self._decoders[row.rid] = IncrementalDecoder(self._tokenizer, row.sampling)
        finish = row.finish
        text = decoder.feed(row.token_ids, finish)
        if finish is None and decoder.stop_hit is not None:
            finish = FinishReason(type="stop", matched=decoder.stop_hit)
            text += decoder.feed([], finish)
            self._closed[row.rid] = None
            if len(self._closed) > CLOSED_RIDS_KEPT:
                self._closed.popitem(last=False)
        if finish is not None:
            del self._decoders[row.rid]
        return RequestOutput(rid=row.rid, text=text, token_ids=row.token_ids, prompt_tokens=row.prompt_tokens,
                             completion_tokens=row.completion_tokens, finish=finish)


async def detokenizer_main(ctx: ActorContext, model: str, shard: int) -> dict[str, Any]:
    """Entry point for the runtime: build the actor and subscribe."""
    return await DetokenizerActor(ctx, model, shard).start()
