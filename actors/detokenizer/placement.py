"""Which detokenizer serves a request: chosen per request by the tokenizer, among the live detokenizers.

Every detokenizer beats on `{ns}.control.heartbeat` (its id is the beat's `rank`). A detokenizer is live while
it beat within `MISSED_BEATS` of its heartbeat intervals (the rule the scheduler router applies to replicas),
so one that dies or hangs stops being chosen within about 1.5 s, and one that starts (or comes back) is
chosen from its first beat; one that drains (its beat says `draining`) is chosen no more. Among the live ones a request goes to the rendezvous hash of its rid
(`ringserve.bus.subjects.detokenizer_for`): every tokenizer worker agrees without sharing state, and a detokenizer
joining or leaving moves no request between the others. The choice is stamped on the request
(`TokenizedRequest.detokenizer`) and never revisited, so nothing already running moves. Before any
detokenizer has beat (a tokenizer just started), the choice is made over the ids the launcher starts.
"""

from __future__ import annotations

from typing import Sequence

from ringserve.bus.messages import MISSED_BEATS, Heartbeat
from ringserve.bus.subjects import detokenizer_for


class DetokenizerPlacement:
    """The live detokenizers, from their heartbeats, and the choice of one per request."""

    def __init__(self, configured: Sequence[int]) -> None:
        """`configured`: the detokenizer ids to choose among while none has beat (not empty)."""
        if not configured:
            raise ValueError("at least one detokenizer id must be configured")
        self._configured = sorted(set(configured))
        self._seen: dict[int, tuple[float, float]] = {}  # id -> (time of its last beat, its beat interval)
        self._draining: set[int] = set()

    def on_heartbeat(self, beat: Heartbeat, now: float) -> None:
        """Take a heartbeat (those of other roles are ignored)."""
        if beat.role == "detokenizer" and beat.rank >= 0:
            self._seen[beat.rank] = (now, beat.interval)
            if beat.draining:
                self._draining.add(beat.rank)
            else:
                self._draining.discard(beat.rank)

    def live(self, now: float) -> list[int]:
        """The detokenizers that beat in time and take new requests (not draining), by id."""
        return sorted(d for d, (seen, interval) in self._seen.items()
                      if now - seen <= MISSED_BEATS * interval and d not in self._draining)

    def choose(self, rid: str, now: float) -> int:
        """The detokenizer for request `rid`: among the live ones; when none is live, among those that ever
        beat (the entry refuses requests while none is live, so this is a request racing that), and before
        any beat among the configured ids."""
        return detokenizer_for(rid, self.live(now) or sorted(self._seen) or self._configured)
