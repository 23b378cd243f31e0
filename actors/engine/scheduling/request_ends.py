"""Requests leaving the engine: taken out of every queue with their KV cached or dropped (finished, failed,
aborted), and the rows the engine answers them with (`EngineCore.ends`)."""

from __future__ import annotations

from typing import MutableMapping

from ringserve.actors.engine.core.request import Req
from ringserve.actors.engine.scheduling.cache_manager import CacheManager
from ringserve.actors.engine.scheduling.decode import DecodeManager
from ringserve.actors.engine.scheduling.engine_stats import StepCounters
from ringserve.actors.engine.scheduling.grammar import GrammarManager
from ringserve.actors.engine.scheduling.output_rows import output_row
from ringserve.actors.engine.scheduling.prefill import PrefillManager
from ringserve.actors.engine.speculative.verify_step import SpeculativeSteps
from ringserve.bus.errors import server_error
from ringserve.bus.messages import FinishReason, TokenRow


class RequestEnds:
    """Ends live requests and makes every request's output rows."""

    def __init__(self, live: MutableMapping[str, Req], decode: DecodeManager, prefill: PrefillManager,
                 grammars: GrammarManager, cache: CacheManager, speculation: SpeculativeSteps | None,
                 counters: StepCounters) -> None:
        """`live`: the engine's live requests by rid; `counters`: where a first row counts its prompt."""
        self.live, self.decode, self.prefill, self.grammars = live, decode, prefill, grammars
        self.cache, self.speculation, self.counters = cache, speculation, counters

    def release(self, req: Req, keep_kv: bool = True) -> None:
        """Take `req` out of every queue; cache its KV (unless it may be garbage) and free the rest."""
        if self.speculation is not None:
            self.speculation.speculator.forget(req)
        if not self.decode.remove(req) and not self.prefill.remove(req):
            self.grammars.remove(req)
        if req.row is not None:
            if keep_kv:
                self.cache.cache_req(req, finished=True)
            else:
                self.cache.drop_req(req)
        del self.live[req.rid]

    def fail(self, req: Req, message: str) -> TokenRow:
        """End `req` with an error finish; its KV from the failed step is not kept."""
        self.release(req, keep_kv=False)
        return self.row(req, [], FinishReason("error", error=server_error(message)))

    def abort(self, rid: str) -> TokenRow | None:
        """Drop a waiting or running request now and free its KV; its final row, or None if `rid` is not live."""
        req = self.live.get(rid)
        if req is None:
            return None
        self.release(req)
        return self.row(req, [], FinishReason("abort"))

    def abort_all(self) -> list[TokenRow]:
        """Abort every live request; their final rows."""
        return [row for rid in list(self.live) if (row := self.abort(rid)) is not None]

    def row(self, req: Req, token_ids: list[int], finish: FinishReason | None) -> TokenRow:
        """`req`'s output row (`output_row`)."""
        if not req.first_row_sent and req.admitted:  # the hit rate counts prompts that reached the prefix cache
            self.counters.prompt_tokens += req.prompt_len
            self.counters.cached_tokens += req.cached_tokens
        return output_row(req, token_ids, finish)
