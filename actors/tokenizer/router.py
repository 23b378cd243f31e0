"""Cache-aware routing of tokenized requests over scheduler replicas (`--dp`), in the tokenizer.

The tokenizer has the token ids, so it routes without an extra hop. Each replica heartbeats its load
(`ReplicaLoad`) and reports what its prefix cache stores and evicts (`KvEvents`, chained hashes of whole
`BLOCK`-token blocks, `bus/kv_blocks.py`); the router keeps one `ReplicaIndex` per replica from those reports,
so it knows what each replica's cache really holds, evictions, flushes and restarts included. A request goes
to the replica holding its longest cached prefix; with none, to the replica the rendezvous hash of its first
block picks. Unless that replica is overloaded against the least loaded one (load = running + waiting + routed
since its last heartbeat, imbalanced when it exceeds the least by more than `BALANCE_ABS` and by a factor
`BALANCE_REL`, as SGLang's router decides): then the least loaded takes it. A request counts against its
replica the moment it is routed. A replica that misses heartbeats, or drains, gets nothing.

Every tokenizer worker subscribes to every replica's events, so workers fed the same events and heartbeats
route the same way without talking to each other. When the chosen replica holds less of the prompt than another
one, the request carries that other replica as a hint (`holder`): with `--kv-share` the chosen replica fetches
the blocks from it instead of computing them. With `--replica-role`, prefill replicas get no routed requests while a
decode (or both) replica is live; a request routed to a decode replica names the least loaded prefill replica
(`prefill_for`), which computes its prompt for the decode replica to fetch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ringserve.actors.tokenizer.kv_index import ReplicaIndex
from ringserve.bus.kv_blocks import BLOCK, block_hashes, salt_seed
from ringserve.bus.kv_messages import KvEvents, KvSnapshot
from ringserve.bus.messages import MISSED_BEATS, ReplicaLoad
from ringserve.bus.subjects import rendezvous

__all__ = ["BALANCE_ABS", "BALANCE_REL", "BLOCK", "MISSED_BEATS", "Router", "block_hashes"]

BALANCE_ABS = 8
BALANCE_REL = 1.5


@dataclass
class _Replica:
    load: ReplicaLoad
    seen_at: float
    pending: int = 0  # routed since its last heartbeat
    routed: int = 0  # since it joined

    @property
    def score(self) -> int:
        return self.load.num_running_reqs + self.load.num_waiting_reqs + self.pending


class Router:
    """Picks a replica per request from their heartbeats and the cache index their KV events build.

    Methods that return True ask the caller to fetch that replica's `KvSnapshot` and pass it to
    `on_kv_snapshot` (or call `snapshot_failed`): the index missed events.
    """

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self._replicas: dict[int, _Replica] = {}
        self._indexes: dict[int, ReplicaIndex] = {}

    def on_heartbeat(self, load: ReplicaLoad, now: float) -> bool:
        """Take a replica's load (a replica joins with its first heartbeat); True: resync its index."""
        replica = self._replicas.get(load.replica)
        if replica is None:
            self._replicas[load.replica] = _Replica(load, now)
        else:
            replica.load, replica.seen_at, replica.pending = load, now, 0
        return self._index(load.replica).on_heartbeat(load.kv_epoch, load.kv_seq)

    def on_kv_events(self, events: KvEvents) -> bool:
        """Apply a replica's cache events; True: a gap, resync its index."""
        return self._index(events.replica).on_events(events)

    def on_kv_snapshot(self, snapshot: KvSnapshot) -> bool:
        """Resync a replica's index from its snapshot; True: events after it are missing, resync again."""
        return self._index(snapshot.replica).on_snapshot(snapshot)

    def snapshot_failed(self, replica_id: int) -> None:
        """The snapshot asked for did not come (the next gap or heartbeat asks again)."""
        self._index(replica_id).snapshot_failed()

    def forget(self, replica_id: int) -> None:
        """Drop a replica and its index at once (it stopped, or failed a hand-over); its next heartbeat resyncs."""
        self._replicas.pop(replica_id, None)
        self._indexes.pop(replica_id, None)

    def live(self, now: float) -> list[int]:
        """Replicas that heartbeat in time and take work, by id."""
        return sorted(rid for rid, r in self._replicas.items()
                      if now - r.seen_at <= MISSED_BEATS * r.load.interval and not r.load.draining)

    def cached_blocks(self, replica_id: int) -> set[bytes]:
        """The block hashes replica `replica_id` holds, as its events reported them."""
        index = self._indexes.get(replica_id)
        return set(index.blocks) if index is not None else set()

    def route(self, ids: Sequence[int], now: float, salt: str | None = None) -> int | None:
        """The replica for a request with prompt `ids` and `cache_salt` `salt` (counted against it), or None when
        none is live."""
        live = self.live(now)
        serving = [r for r in live if self._replicas[r].load.role != "prefill"]
        live = serving or live  # prefill replicas compute prompts for the others (--role); alone, they serve
        if not live:
            return None
        hashes = block_hashes(ids, self.block, salt_seed(salt))
        chosen = self._longest_prefix(live, hashes)
        if chosen is None:
            chosen = rendezvous(hashes[0] if hashes else bytes(str(list(ids[:self.block])), "ascii"), live)
        least = min(live, key=lambda r: (self._replicas[r].score, r))
        c, m = self._replicas[chosen].score, self._replicas[least].score
        if c - m > BALANCE_ABS and c > BALANCE_REL * m:
            chosen = least
        replica = self._replicas[chosen]
        replica.pending += 1
        replica.routed += 1
        return chosen

    def holder(self, ids: Sequence[int], chosen: int, now: float, salt: str | None = None) -> tuple[int, int]:
        """`(replica, blocks)`: the live replica other than `chosen` holding the most leading blocks of `ids`,
        when it holds more than `chosen` does (`(-1, 0)` otherwise): where `chosen` may fetch them (--kv-share)."""
        hashes = block_hashes(ids, self.block, salt_seed(salt))
        held = {rid: self._held(rid, hashes) for rid in self.live(now)}
        best = max((rid for rid in held if rid != chosen), key=lambda rid: (held[rid], -rid), default=None)
        if best is None or held[best] <= held.get(chosen, 0):
            return -1, 0
        return best, held[best]

    def prefill_for(self, chosen: int, now: float) -> int:
        """The least loaded live prefill replica (`--replica-role prefill`) to compute a prompt for decode replica
        `chosen`, or -1 (`chosen` is not a decode replica, or no prefill replica is live)."""
        replica = self._replicas.get(chosen)
        if replica is None or replica.load.role != "decode":
            return -1
        prefill = [r for r in self.live(now) if self._replicas[r].load.role == "prefill"]
        if not prefill:
            return -1
        best = min(prefill, key=lambda r: (self._replicas[r].score, r))
        self._replicas[best].pending += 1
        return best

    def stats(self) -> dict[int, int]:
        """Requests routed to each known replica since it joined."""
        return {rid: r.routed for rid, r in self._replicas.items()}

    def _index(self, replica_id: int) -> ReplicaIndex:
        index = self._indexes.get(replica_id)
        if index is None:
            index = self._indexes[replica_id] = ReplicaIndex()
        return index

    def _held(self, replica_id: int, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, replica `replica_id` holds."""
        index = self._indexes.get(replica_id)
        n = 0
        while index is not None and n < len(hashes) and hashes[n] in index.blocks:
            n += 1
        return n

    def _longest_prefix(self, live: list[int], hashes: list[bytes]) -> int | None:
        best, best_len = None, 0
        for rid in live:
            n = self._held(rid, hashes)
            if n > best_len:
                best, best_len = rid, n
        return best
