"""Scheduler actor (one per tensor-parallel rank; rank 0 reads the bus).

Loop: apply what arrived (new requests, aborts) -> one engine step in a worker thread, so the bus stays
responsive during the forward pass -> publish that step's token rows, one message per detokenizer shard.
The engine is touched only between steps, from this loop, so it needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actors.common.model_source import resolve_model
from actors.common.runtime import ActorContext
from actors.engine.engine import Engine, EngineConfig
from bus.connection import Delivery
from bus.messages import (
    AbortRequest, Accepted, BatchTokenOutput, FinishReason, InfoQuery, RequestOutput, SchedulerInfo, TokenizedRequest,
    TokenRow,
)
from bus.subjects import SCHEDULER_QUEUE, detokenizer_shard
from observability.logging import log_event

log = logging.getLogger("scheduler")
ABORT_MEMORY_SECONDS = 60.0


class SchedulerActor:
    """Bridges the bus and the engine."""

    def __init__(self, ctx: ActorContext, model: str, config: EngineConfig, detokenizer_shards: int) -> None:
        self._ctx = ctx
        self._shards = detokenizer_shards
        self._source = resolve_model(model)
        self._engine = Engine.from_source(self._source, config)
        self._inbox: list[tuple[str, Any]] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        # aborts that arrived before their request (the two travel on different subjects)
        self._early_aborts: OrderedDict[str, float] = OrderedDict()
        self._step = 0
        self._info = self._snapshot()

    async def start(self) -> dict[str, Any]:
        subjects = self._ctx.subjects
        await self._ctx.bus.subscribe(subjects.tokenized, TokenizedRequest, self._on_request, queue=SCHEDULER_QUEUE)
        await self._ctx.bus.subscribe(subjects.abort_any, AbortRequest, self._on_abort)
        await self._ctx.bus.subscribe(subjects.scheduler_info, InfoQuery, self._on_info)
        self._loop_task = asyncio.get_running_loop().create_task(self._run())
        return {"kv_total_tokens": self._info.kv_total_tokens, "context_length": self._info.context_length}

    async def _on_request(self, req: TokenizedRequest, delivery: Delivery) -> Accepted:
        self._inbox.append(("add", req))
        self._wake.set()
        return Accepted(rid=req.rid)

    async def _on_abort(self, msg: AbortRequest, delivery: Delivery) -> None:
        self._inbox.append(("abort", self._ctx.subjects.rid_of(delivery.subject)))
        self._wake.set()

    async def _on_info(self, query: InfoQuery, delivery: Delivery) -> SchedulerInfo:
        return self._info

    def _snapshot(self) -> SchedulerInfo:
        stats = self._engine.stats()
        return SchedulerInfo(
            rank=self._ctx.rank, num_running_reqs=stats.num_running_reqs, num_waiting_reqs=stats.num_waiting_reqs,
            kv_used_tokens=stats.kv_used_tokens, kv_total_tokens=stats.kv_total_tokens,
            context_length=stats.context_length, step=self._step, model=self._source.name)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._ctx.stopping.is_set():
                await self._publish(await self._apply_inbox())
                self._info = self._snapshot()
                if not self._engine.has_work():
                    self._wake.clear()
                    if not self._inbox:
                        await self._wake.wait()
                    continue
                rows = await loop.run_in_executor(self._executor, self._engine.step)
                self._step += 1
                await self._publish(rows)
        except Exception as exc:
            log.exception("engine loop crashed")
            self._ctx.fail(f"engine loop crashed: {exc!r}")

    async def _apply_inbox(self) -> list[TokenRow]:
        inbox, self._inbox = self._inbox, []
        rows: list[TokenRow] = []
        now = time.monotonic()
        while self._early_aborts and next(iter(self._early_aborts.values())) < now - ABORT_MEMORY_SECONDS:
            self._early_aborts.popitem(last=False)
        for kind, item in inbox:
            if kind == "abort":
                row = self._engine.abort(item)
                if row is None:
                    self._early_aborts[item] = now
                else:
                    rows.append(row)
            elif item.rid in self._early_aborts:
                del self._early_aborts[item.rid]
                rows.append(TokenRow(rid=item.rid, token_ids=[], prompt_tokens=len(item.input_ids),
                                     completion_tokens=0, finish=FinishReason(type="abort")))
            else:
                error = self._engine.add_request(item)
                if error is not None:
                    await self._ctx.bus.publish(self._ctx.subjects.output(item.rid),
                                                RequestOutput(rid=item.rid, error=error))
        return rows

    async def _publish(self, rows: list[TokenRow]) -> None:
        if not rows:
            return
        by_shard: dict[int, list[TokenRow]] = defaultdict(list)
        for row in rows:
            by_shard[detokenizer_shard(row.rid, self._shards)].append(row)
        for shard, shard_rows in by_shard.items():
            await self._ctx.bus.publish(self._ctx.subjects.tokens(shard), BatchTokenOutput(self._step, shard_rows))
        if any(row.finish is not None for row in rows):
            log_event(log, logging.DEBUG, "finished", rids=",".join(r.rid for r in rows if r.finish is not None))


async def scheduler_main(ctx: ActorContext, model: str, config: EngineConfig, shards: int) -> dict[str, Any]:
    """Entry point for the runtime: load the model, subscribe, start the loop."""
    return await SchedulerActor(ctx, model, config, shards).start()
