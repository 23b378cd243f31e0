"""The running requests (those that decode one token per step) and retraction when the pool runs short."""

from __future__ import annotations

from actors.engine.cache_manager import CacheManager
from actors.engine.request import Req


class DecodeManager:
    """Running requests in admission order; the newest are retracted first."""

    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache
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

    def retract_until_decodable(self) -> list[Req]:
        """Retract the newest running requests until every remaining one has a slot for its next token.

        A retracted request's KV goes to the prefix cache (only its unshared part was ever its own), so it
        may find much of it again when it is re-admitted; its output so far is kept, never resent.
        """
        retracted: list[Req] = []
        while self.running and len(self.running) > self.cache.available:
            req = self.running.pop()
            self.cache.cache_req(req, finished=True)
            retracted.append(req)
        return retracted

    def schedule(self) -> list[Req]:
        """Allocate one slot per running request for this step's token; returns the decode rows."""
        self.cache.extend_by_one(self.running)
        return list(self.running)
