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
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ringserve.actors.scheduler.engine_thread import on_engine_thread
from ringserve.bus.kv_blocks import BLOCK
from ringserve.bus.kv_transfer import KvFetchReply, KvFetchRequest, checksum, fetch_blocks, reply_budget
from ringserve.bus.messages import TokenizedRequest
from ringserve.observability import tracing
from ringserve.observability.logging import log_event

log = logging.getLogger("scheduler.kv_share")


class KvSharing:
    """One replica's side of KV sharing: its counters, its fetch responder and its fetches."""

    def __init__(self, ctx: Any, engine: Any, spans: Any, fetch_timeout: float) -> None:
        self._ctx, self._engine, self._spans = ctx, engine, spans
        self.fetch_timeout = fetch_timeout
        self.namespace: str | None = engine.kv_share_namespace()
        self.fetched_blocks = self.fetched_bytes = self.failures = self.served_blocks = 0
        self.fetch_seconds = 0.0

    async def start(self) -> None:
        """Answer other replicas' fetches."""
        await self._ctx.bus.subscribe(self._ctx.subjects.kv_fetch(self._ctx.rank), KvFetchRequest, self._serve)

    def counters(self) -> dict[str, Any]:
        """`SchedulerInfo`'s `kv_fetch*`/`kv_served_blocks` fields."""
        return {"kv_fetched_blocks": self.fetched_blocks, "kv_fetched_bytes": self.fetched_bytes,
                "kv_fetch_seconds": self.fetch_seconds, "kv_fetch_failures": self.failures,
                "kv_served_blocks": self.served_blocks}

    def wants_fetch(self, req: TokenizedRequest) -> bool:
        """Whether the router hinted another replica holds more of `req`'s prefix than routing gave here."""
        return (self.namespace is not None and req.kv_peer >= 0 and req.kv_peer != self._ctx.rank
                and req.kv_peer_blocks > 0 and not req.images)

    async def _serve(self, ask: KvFetchRequest, delivery: Any) -> KvFetchReply:
        if ask.namespace != self.namespace:
            return KvFetchReply(error="this replica's KV is keyed apart (other weights, kernels or pool layout)")
        ids = list(ask.input_ids)
        blocks = await on_engine_thread(self._engine.kv_export, ids, ask.cache_key, ask.first_block,
                                        max(0, ask.max_blocks), reply_budget(self._ctx.bus.max_payload))
        self.served_blocks += len(blocks)
        return KvFetchReply(blocks=blocks, checksums=[checksum(b) for b in blocks])

    async def prefetch(self, req: TokenizedRequest) -> None:
        """Fetch the blocks of `req`'s prefix that its hinted holder has and this replica lacks into the tier."""
        started_ns, started = tracing.now_ns(), time.monotonic()
        ids = list(req.input_ids[: req.kv_peer_blocks * BLOCK])
        cache_key = self._engine.kv_cache_key(req)
        have = await on_engine_thread(self._engine.kv_held_blocks, ids, cache_key)
        wanted = len(ids) // BLOCK - have
        if wanted <= 0:
            return
        ask = KvFetchRequest(ids, cache_key, self.namespace or "", have, wanted)
        result = await fetch_blocks(self._ctx.bus, self._ctx.subjects.kv_fetch(req.kv_peer), ask,
                                    self.fetch_timeout)
        error = ""
        if result.blocks:
            try:
                await on_engine_thread(self._engine.kv_import, ids, cache_key, have, result.blocks)
            except ValueError as exc:  # a holder with the same namespace but not this pool's layout
                error = str(exc)
        if len(result.blocks) < wanted or error:
            self.failures += 1
            log_event(log, logging.INFO, "fetched fewer KV blocks than asked; computing the rest", rid=req.rid,
                      holder=req.kv_peer, fetched=len(result.blocks), wanted=wanted, why=error or result.stopped)
        if not error:
            self.fetched_blocks += len(result.blocks)
            self.fetched_bytes += result.bytes
        self.fetch_seconds += time.monotonic() - started
        self._spans.fetched(req.rid, started_ns, {"ringserve.kv.holder": req.kv_peer,
                                                  "ringserve.kv.blocks_wanted": wanted,
                                                  "ringserve.kv.blocks_fetched": len(result.blocks),
                                                  "ringserve.kv.bytes": result.bytes,
                                                  "ringserve.kv.replies": result.replies},
                            error or (result.stopped if len(result.blocks) < wanted else ""))
