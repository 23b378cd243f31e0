"""The running requests (those that decode one token per step) and retraction when the pool runs short."""

from __future__ import annotations

from ringserve.actors.engine.models.rope import RopeLengthRule
from ringserve.actors.engine.scheduling.cache_manager import CacheManager
from ringserve.actors.engine.core.request import Req


class DecodeManager:
    """Running requests in admission order; the newest are retracted first.

    A request joins when the step that samples its first token is launched, and leaves when it finishes
    (applied on the host), aborts or is retracted. One whose token in flight already ends it by length stays
    until that token is applied but is not decoded again.
    """

    def __init__(self, cache: CacheManager, context_length: int, rope_rule: RopeLengthRule | None = None) -> None:
        self.cache = cache
        self.context_length = context_length
        self.rope_rule = rope_rule
        self.running: list[Req] = []

    def __len__(self) -> int:
        return len(self.running)

    def add(self, req: Req) -> None:
        self.running.append(req)

    def remove(self, req: Req) -> bool:
        """Take `req` out of the running set; False if it is not running."""
        try:
            self.running.remove(req)
        except ValueError:
            return False
        return True

    def decodable(self) -> list[Req]:
        """The running requests the next step decodes: all but those already ending by length."""
        return [req for req in self.running if not req.ends_by_length(self.context_length)]

    def must_retract(self) -> bool:
        """Whether the pool is too short to give every decodable request a slot for its next token."""
        return len(self.decodable()) > self.cache.available

    def retract_until_decodable(self) -> list[Req]:
        """Retract the newest running requests until every remaining one has a slot for its next token.

        A retracted request's KV goes to the prefix cache (only its unshared part was ever its own), so it
        may find much of it again when it is re-admitted; its output so far is kept, never resent. Only called
        with every launched step applied (the overlap loop drains first when `must_retract`).
        """
        retracted: list[Req] = []
        decoding = self.decodable()
        while decoding and len(decoding) > self.cache.available:
            req = decoding.pop()
            assert req.device_len == req.seq_len, "retraction needs the step in flight applied first"
            self.running.remove(req)
            self.cache.cache_req(req, finished=True)
            retracted.append(req)
        return retracted

    def reencode_due(self) -> list[Req]:
        """The decodable requests whose next token first passes a longrope model's original context: all their
        keys are computed again with the long factors first (`RopeLengthRule.reencodes`)."""
        rule = self.rope_rule
        if rule is None or rule.kind != "longrope":
            return []
        return [req for req in self.decodable() if rule.reencodes(req.rope_floor, req.device_len - 1)]

    def retract_to_reencode(self) -> list[Req]:
        """Retract the requests `reencode_due` names, their floor raised to their whole sequence, so admission
        computes every token of it again, rotated as one long sequence (their old KV goes to the prefix cache's
        tree of short keys, which the raised floor no longer reads). Only with every launched step applied."""
        retracted = self.reencode_due()
        for req in retracted:
            assert req.device_len == req.seq_len, "retraction needs the step in flight applied first"
            self.running.remove(req)
            self.cache.cache_req(req, finished=True)
            assert self.rope_rule is not None
            req.rope_floor = req.seq_len
            req.rope_cache_name = self.rope_rule.cache_name(req.rope_floor)
        return retracted

    def schedule(self) -> list[Req]:
        """Allocate one slot per decodable request for this step's token; returns the decode rows."""
        reqs = self.decodable()
        self.cache.extend_by_one(reqs)
        return reqs
