"""One scheduler replica's prefix-cache index as the tokenizer's router knows it: the block hashes the replica
reported stored and not since evicted (`KvEvents` on `{ns}.kv.events.{r}`).

Events are applied in sequence order. A gap (a lost message, or an index that joined late) makes the index
ask for a `KvSnapshot` (`{ns}.kv.snapshot.{r}`); events arriving meanwhile are kept and applied on top of it.
A replica's heartbeat carries its last sequence number, so a lost last event of a replica that then fell
quiet is noticed one heartbeat later. A new epoch is a restarted replica: its cache starts empty. The index is
a pure function of what it was fed, so every tokenizer worker fed the same events holds the same index.
"""

from __future__ import annotations

from ringserve.bus.kv_messages import KvEvents, KvSnapshot


class ReplicaIndex:
    """The block hashes one replica holds, kept in step with its events; methods returning True ask the caller
    to fetch the replica's snapshot and hand it to `on_snapshot` (or `snapshot_failed`)."""

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.seq = 0  # the last event applied
        self.blocks: set[bytes] = set()
        self.resyncing = False  # a snapshot was asked for and has not come
        self._buffered: dict[int, KvEvents] = {}  # events after a gap, by seq, applied on top of the snapshot
        self._retired: set[str] = set()  # epochs of incarnations that were replaced: their messages are stale
        self._beat_seq = 0  # the seq the previous heartbeat announced

    def on_events(self, events: KvEvents) -> bool:
        """Apply `events`; True when a gap before them needs a snapshot."""
        if events.epoch in self._retired:
            return False
        if events.epoch != self.epoch:
            self._reset(events.epoch)  # a new incarnation: its cache started empty
        if events.seq <= self.seq:
            return False  # already applied (or covered by the snapshot)
        if self.resyncing or events.seq != self.seq + 1:
            self._buffered[events.seq] = events
            if self.resyncing:
                return False
            self.resyncing = True
            return True
        self._apply(events)
        return False

    def on_snapshot(self, snapshot: KvSnapshot) -> bool:
        """Replace the index by `snapshot`, then apply the events buffered after it; True when they leave a gap."""
        if snapshot.epoch in self._retired:
            return False
        if snapshot.epoch != self.epoch:
            self._reset(snapshot.epoch)
        self.resyncing = False
        if snapshot.seq < self.seq:
            return False  # older than what was applied since: keep the newer state
        self.blocks, self.seq = set(snapshot.blocks), snapshot.seq
        buffered, self._buffered = self._buffered, {}
        for seq in sorted(buffered):
            if seq <= self.seq:
                continue
            if seq != self.seq + 1:
                self._buffered = {s: e for s, e in buffered.items() if s >= seq}
                self.resyncing = True
                return True
            self._apply(buffered[seq])
        return False

    def snapshot_failed(self) -> None:
        """The snapshot did not come: the next gap or heartbeat asks again."""
        self.resyncing = False

    def on_heartbeat(self, epoch: str, seq: int) -> bool:
        """Take the replica's announced epoch and last seq; True when the index must resync: a new incarnation
        that already published events, or a seq the previous heartbeat announced still not applied."""
        if not epoch or epoch in self._retired:
            return False  # a replica that publishes no events (or a stale beat of a replaced one)
        if epoch != self.epoch:
            self._reset(epoch)
            self._beat_seq = seq
            if seq == 0:
                return False
            self.resyncing = True
            return True
        behind = self.seq < self._beat_seq
        self._beat_seq = seq
        if behind and not self.resyncing:
            self.resyncing = True
            return True
        return False

    def _apply(self, events: KvEvents) -> None:
        self.blocks.difference_update(events.removed)
        self.blocks.update(events.stored)
        self.seq = events.seq

    def _reset(self, epoch: str) -> None:
        if self.epoch is not None:
            self._retired.add(self.epoch)
        self.epoch, self.seq, self.blocks = epoch, 0, set()
        self.resyncing, self._buffered, self._beat_seq = False, {}, 0
