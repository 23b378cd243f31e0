"""`--kv-share`: a scheduler replica serves its KV blocks to the others and fetches a prompt's prefix from the
replica the router says holds it, before the engine admits the request.

Serving: `{ns}.kv.fetch.{replica}` answers a `KvFetchRequest` with the blocks this replica holds (pool, then
tier), exported on the engine thread between steps, as many as one message carries. Fetching: a request the
router sent here with a hint (`TokenizedRequest.kv_peer`, holding `kv_peer_blocks` blocks) waits, before
admission, for the blocks this replica lacks, asked of the holder in chunks with a deadline
(`--kv-fetch-timeout`) and checked block by block (`bus/kv_transfer.py`). They go into this replica's tier, and
the engine's admission loads them as any tier block: the tokens are those a computed prefix gives. A fetch that
stops short (deadline, holder gone, a bad checksum) loads what came and computes the rest; it never fails the
request. Other requests keep stepping meanwhile: the fetch awaits the bus, not the engine.

Prefill/decode split (`--replica-role`): a request routed to a decode replica names a prefill replica
(`TokenizedRequest.kv_prefill`). The decode replica asks it (`{ns}.kv.prefill.{replica}`) to compute the
prompt's whole blocks: the prefill replica runs them as a request of its own (one token, its rows never
published) whose KV its prefix cache keeps, and answers when it is done. The decode replica then fetches those
blocks as above, computes the last partial block and the first token itself, and streams the rest. A prefill
replica that fails, is gone or does not answer within `--prefill-timeout` only means the decode replica
computes the whole prompt.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Callable

from ringserve.actors.common.runtime import ActorContext
from ringserve.actors.engine.interface import EngineInterface
from ringserve.actors.scheduler.engine_thread import on_engine_thread
from ringserve.actors.scheduler.request_spans import NoSpans
from ringserve.bus.kv_blocks import BLOCK
from ringserve.bus.kv_transfer import (KvFetchReply, KvFetchRequest, KvPrefillReply, KvPrefillRequest, checksum,
                                       fetch_blocks, reply_budget)
from ringserve.bus.messages import TokenizedRequest, TokenRow
from ringserve.bus.params import SamplingParams
from ringserve.observability import tracing
from ringserve.observability.logging import log_event

log = logging.getLogger("scheduler.kv_share")


class KvSharing:
    """One replica's side of KV sharing: its counters, its fetch responder and its fetches."""

    def __init__(self, ctx: ActorContext, engine: EngineInterface, spans: NoSpans, fetch_timeout: float,
                 prefill_timeout: float = 60.0, enqueue: Callable[[TokenizedRequest], None] | None = None) -> None:
        """`enqueue` hands a request of this replica's own (a prefill job) to its engine like any other."""
        self._ctx, self._engine, self._spans = ctx, engine, spans
        self.fetch_timeout, self.prefill_timeout = fetch_timeout, prefill_timeout
        self._enqueue = enqueue
        self._jobs: dict[str, asyncio.Future[TokenRow]] = {}  # prefill jobs by rid, until their final row
        self._tasks: set[asyncio.Task[None]] = set()
        self.namespace: str | None = engine.kv_share_namespace()
        self.fetched_blocks = self.fetched_bytes = self.failures = self.served_blocks = 0
        self.fetch_seconds = 0.0

    async def start(self) -> None:
        """Answer other replicas' fetches."""
        await self._ctx.bus.subscribe(self._ctx.subjects.kv_fetch(self._ctx.rank), KvFetchRequest, self._serve)
        if self._enqueue is not None:
            await self._ctx.bus.subscribe(self._ctx.subjects.kv_prefill(self._ctx.rank), KvPrefillRequest,
                                          self._serve_prefill)

    def counters(self) -> dict[str, Any]:
        """`SchedulerInfo`'s `kv_fetch*`/`kv_served_blocks` fields."""
        return {"kv_fetched_blocks": self.fetched_blocks, "kv_fetched_bytes": self.fetched_bytes,
                "kv_fetch_seconds": self.fetch_seconds, "kv_fetch_failures": self.failures,
                "kv_served_blocks": self.served_blocks}

    def wants_fetch(self, req: TokenizedRequest) -> bool:
        """Whether the router hinted another replica holds more of `req`'s prefix than routing gave here."""
        if self.namespace is None or req.images or len(req.input_ids) < BLOCK:
            return False
        hinted = req.kv_peer >= 0 and req.kv_peer != self._ctx.rank and req.kv_peer_blocks > 0
        return hinted or (req.kv_prefill >= 0 and req.kv_prefill != self._ctx.rank)

    async def _serve(self, ask: KvFetchRequest, delivery: Any) -> KvFetchReply:
        if ask.namespace != self.namespace:
            return KvFetchReply(error="this replica's KV is keyed apart (other weights, kernels or pool layout)")
        ids = list(ask.input_ids)
        blocks = await on_engine_thread(self._engine.kv_export, ids, ask.cache_key, ask.first_block,
                                        max(0, ask.max_blocks), reply_budget(self._ctx.bus.max_payload))
        self.served_blocks += len(blocks)
        return KvFetchReply(blocks=blocks, checksums=[checksum(b) for b in blocks])

    def take_job_rows(self, rows: list[TokenRow]) -> tuple[list[TokenRow], list[str]]:
        """`rows` less the prefill jobs' (never published), and the jobs whose final row came."""
        if not self._jobs:
            return rows, []
        rest, ended = [], []
        for row in rows:
            job = self._jobs.get(row.rid)
            if job is None:
                rest.append(row)
            elif row.finish is not None:
                ended.append(row.rid)
                del self._jobs[row.rid]
                if not job.done():
                    job.set_result(row)
        return rest, ended

    async def _serve_prefill(self, ask: KvPrefillRequest, delivery: Any) -> KvPrefillReply:
        """Take `ask`'s prompt as a request of this replica's own; its end is told to `ask.notify` (the handler
        answers at once, so the prompts of several decode replicas prefill in one batch)."""
        if ask.namespace != self.namespace:
            return KvPrefillReply(error="this replica's KV is keyed apart (other weights, kernels or pool layout)")
        if not ask.notify.startswith("_INBOX."):  # this actor publishes only to a requester's inbox
            return KvPrefillReply(error="notify must be the asker's inbox")
        assert self._enqueue is not None
        rid = f"prefill-{uuid.uuid4().hex[:16]}"
        job: asyncio.Future[TokenRow] = asyncio.get_running_loop().create_future()
        self._jobs[rid] = job
        sampling = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, cache_salt=ask.cache_salt,
                                  lora_name=ask.lora_name)
        self._enqueue(TokenizedRequest(rid=rid, input_ids=list(ask.input_ids), sampling=sampling))
        task = asyncio.get_running_loop().create_task(self._notify_when_done(rid, job, ask))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return KvPrefillReply()

    async def _notify_when_done(self, rid: str, job: asyncio.Future[TokenRow], ask: KvPrefillRequest) -> None:
        try:
            row = await asyncio.wait_for(job, self.prefill_timeout)
            done = row.finish is not None and row.finish.type in ("stop", "length")
            why = "" if done else (row.finish.error.message if row.finish and row.finish.error else "it ended early")
        except asyncio.TimeoutError:
            why = "the prefill did not finish in time"
        finally:
            self._jobs.pop(rid, None)
        reply = KvPrefillReply(blocks=len(ask.input_ids) // BLOCK) if not why else KvPrefillReply(error=why)
        await self._ctx.bus.publish(ask.notify, reply)

    async def _prefill_elsewhere(self, req: TokenizedRequest, ids: list[int]) -> tuple[int, int, str]:
        """Have prefill replica `req.kv_prefill` compute `ids`: `(holder, blocks it holds, why not)`."""
        bus = self._ctx.bus
        done: asyncio.Future[KvPrefillReply] = asyncio.get_running_loop().create_future()

        async def on_done(reply: KvPrefillReply, delivery: Any) -> None:
            if not done.done():
                done.set_result(reply)

        notify = bus.client.new_inbox()
        sub = await bus.subscribe(notify, KvPrefillReply, on_done)
        try:
            ask = KvPrefillRequest(ids, self.namespace or "", notify, req.sampling.cache_salt, req.sampling.lora_name)
            taken = await bus.request(self._ctx.subjects.kv_prefill(req.kv_prefill), ask, KvPrefillReply,
                                      min(10.0, self.prefill_timeout))
            reply = taken if taken.error else await asyncio.wait_for(done, self.prefill_timeout)
        except asyncio.TimeoutError:
            return -1, 0, "the prefill replica did not answer in time"
        except Exception as exc:  # no responders: the prefill replica is gone
            return -1, 0, f"the prefill replica failed: {exc!r}"[:300]
        finally:
            await sub.unsubscribe()
        return (req.kv_prefill, reply.blocks, "") if not reply.error else (-1, 0, reply.error)

    async def prefetch(self, req: TokenizedRequest) -> None:
        """Fetch the blocks of `req`'s prefix that another replica holds (the hinted holder, or the prefill
        replica after it computed them) and this replica lacks, into the tier."""
        started_ns, started = tracing.now_ns(), time.monotonic()
        split = req.kv_peer < 0
        holder, blocks = (req.kv_prefill, len(req.input_ids) // BLOCK) if split else (req.kv_peer, req.kv_peer_blocks)
        ids = list(req.input_ids[: blocks * BLOCK])
        cache_key = self._engine.kv_cache_key(req)
        have = await on_engine_thread(self._engine.kv_held_blocks, ids, cache_key)
        wanted = len(ids) // BLOCK - have
        if wanted <= 0:
            return
        if split:
            holder, blocks, why = await self._prefill_elsewhere(req, ids)
            if holder < 0:
                self.failures += 1
                log_event(log, logging.INFO, "no prefill replica computed the prompt; computing it", rid=req.rid,
                          why=why)
                self._spans.fetched(req.rid, started_ns, {"ringserve.kv.prefill": req.kv_prefill}, why)
                return
        ask = KvFetchRequest(ids, cache_key, self.namespace or "", have, wanted)
        result = await fetch_blocks(self._ctx.bus, self._ctx.subjects.kv_fetch(holder), ask, self.fetch_timeout)
        error = ""
        if result.blocks:
            try:
                await on_engine_thread(self._engine.kv_import, ids, cache_key, have, result.blocks)
            except ValueError as exc:  # a holder with the same namespace but not this pool's layout
                error = str(exc)
        if len(result.blocks) < wanted or error:
            self.failures += 1
            log_event(log, logging.INFO, "fetched fewer KV blocks than asked; computing the rest", rid=req.rid,
                      holder=holder, fetched=len(result.blocks), wanted=wanted, why=error or result.stopped)
        if not error:
            self.fetched_blocks += len(result.blocks)
            self.fetched_bytes += result.bytes
        self.fetch_seconds += time.monotonic() - started
        self._spans.fetched(req.rid, started_ns, {"ringserve.kv.holder": holder, "ringserve.kv.prefilled": split,
                                                  "ringserve.kv.blocks_wanted": wanted,
                                                  "ringserve.kv.blocks_fetched": len(result.blocks),
                                                  "ringserve.kv.bytes": result.bytes,
                                                  "ringserve.kv.replies": result.replies},
                            error or (result.stopped if len(result.blocks) < wanted else ""))
