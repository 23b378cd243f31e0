"""The scheduler's publisher of its prefix cache's KV events, for the tokenizers' routers.

After each engine step (and after commands such as `/flush_cache`) the scheduler takes the block hashes the
engine's prefix cache stored and evicted (`EngineInterface.kv_events`) and, when there are any, publishes one
`KvEvents` on `{ns}.kv.events.{replica}` with the next sequence number of this incarnation's `epoch`. The
publisher mirrors the hashes it published, so it answers a `KvSnapshot` request (`{ns}.kv.snapshot.{replica}`)
from the bus's event loop at once, consistent with the seq it names, without touching the engine while a step
runs. The epoch and seq ride in the heartbeat's `ReplicaLoad` too. A failed publish is logged and skipped: the
receivers see the gap and resync.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict

from ringserve.bus.connection import BusConnection, Delivery
from ringserve.bus.kv_blocks import HASH_BYTES
from ringserve.bus.kv_messages import KvEvents, KvSnapshot
from ringserve.bus.messages import InfoQuery
from ringserve.bus.subjects import Subjects
from ringserve.observability.logging import log_event

log = logging.getLogger("scheduler")
HASH_WIRE_BYTES = HASH_BYTES + 2  # msgpack bin 8: a type byte and a length byte
ENVELOPE_BYTES = 4096  # headers, the envelope and the other fields, generously


class KvEventPublisher:
    """Publishes one replica's cache events in sequence and answers snapshot requests from its mirror."""

    def __init__(self, bus: BusConnection, subjects: Subjects, replica: int) -> None:
        self._bus = bus
        self._subjects = subjects
        self.replica = replica
        self.epoch = uuid.uuid4().hex[:16]  # this incarnation: a restarted replica starts a new index
        self.seq = 0
        self._held: OrderedDict[bytes, None] = OrderedDict()  # what the published events add up to, oldest first

    async def start(self) -> None:
        await self._bus.subscribe(self._subjects.kv_snapshot(self.replica), InfoQuery, self._on_snapshot)

    @property
    def _per_message(self) -> int:
        return max(1, (self._bus.max_payload - ENVELOPE_BYTES) // HASH_WIRE_BYTES)

    async def publish(self, stored: list[bytes], removed: list[bytes]) -> None:
        """Publish what the cache stored and evicted since the last call (nothing when neither has any)."""
        limit = self._per_message
        while stored or removed:
            part_removed, removed = removed[:limit], removed[limit:]
            part_stored, stored = stored[: limit - len(part_removed)], stored[limit - len(part_removed):]
            for h in part_removed:
                self._held.pop(h, None)
            for h in part_stored:
                self._held[h] = None
                self._held.move_to_end(h)
            self.seq += 1
            message = KvEvents(replica=self.replica, epoch=self.epoch, seq=self.seq, stored=part_stored,
                               removed=part_removed)
            try:
                await self._bus.publish(self._subjects.kv_events(self.replica), message)
            except Exception as exc:  # the routers see the gap and ask for a snapshot
                log_event(log, logging.WARNING, "publishing KV events failed", seq=self.seq, error=repr(exc)[:300])

    def snapshot(self) -> KvSnapshot:
        """Every block hash held after event `seq`, the newest first (as many as one message carries)."""
        limit = self._per_message
        newest = list(reversed(self._held))
        return KvSnapshot(replica=self.replica, epoch=self.epoch, seq=self.seq, blocks=newest[:limit],
                          truncated=len(newest) > limit)

    async def _on_snapshot(self, query: InfoQuery, delivery: Delivery) -> KvSnapshot:
        return self.snapshot()
