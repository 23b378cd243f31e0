"""Cache-aware routing of tokenized requests over scheduler replicas (`--dp`), in the tokenizer.

The tokenizer has the token ids, so it routes without an extra hop. Each replica heartbeats its load
(`ReplicaLoad`); the router keeps, per replica, the prefixes it routed there (chained hashes of
`BLOCK`-token blocks, LRU-bounded to about the replica's KV size), which approximates what that replica's
prefix cache holds. A request goes to the replica holding its longest routed prefix; with none, to the
replica the rendezvous hash of its first block picks, so every tokenizer worker sends a new prefix to the same
replica without sharing state. Unless that replica is overloaded against the least loaded one (load = running
+ waiting + routed since its last heartbeat, imbalanced when it exceeds the least by more than
`BALANCE_ABS` and by a factor `BALANCE_REL`, as SGLang's router decides): then the least loaded takes it. A
request counts against its replica the moment it is routed. A replica that misses heartbeats, or drains,
gets nothing.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from bus.messages import ReplicaLoad

BLOCK = 64  # tokens per hashed block: prefixes are matched in whole blocks
BALANCE_ABS = 8
BALANCE_REL = 1.5
MISSED_BEATS = 3  # a replica silent for this many heartbeat intervals is down


def block_hashes(ids: Sequence[int], block: int = BLOCK) -> list[bytes]:
    """Chained hashes of `ids`' whole blocks: entry i identifies the prefix of `(i + 1) * block` tokens."""
    out, prev = [], b""
    for start in range(0, len(ids) - block + 1, block):
        digest = hashlib.blake2b(prev + bytes(str(ids[start:start + block]), "ascii"), digest_size=16).digest()
        out.append(digest)
        prev = digest
    return out


@dataclass
class _Replica:
    load: ReplicaLoad
    seen_at: float
    pending: int = 0  # routed since its last heartbeat
    routed: int = 0  # since it joined
    prefixes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    @property
    def score(self) -> int:
        return self.load.num_running_reqs + self.load.num_waiting_reqs + self.pending


class Router:
    """Picks a replica per request from their heartbeats and the prefixes routed to each."""

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self._replicas: dict[int, _Replica] = {}

    def on_heartbeat(self, load: ReplicaLoad, now: float) -> None:
        """Take a replica's load (a replica joins with its first heartbeat)."""
        replica = self._replicas.get(load.replica)
        if replica is None:
            self._replicas[load.replica] = _Replica(load, now)
            return
        replica.load, replica.seen_at, replica.pending = load, now, 0

    def forget(self, replica_id: int) -> None:
        """Drop a replica at once (it stopped, or failed a hand-over)."""
        self._replicas.pop(replica_id, None)

    def live(self, now: float) -> list[int]:
        """Replicas that heartbeat in time and take work, by id."""
        return sorted(rid for rid, r in self._replicas.items()
                      if now - r.seen_at <= MISSED_BEATS * r.load.interval and not r.load.draining)

    def route(self, ids: Sequence[int], now: float) -> int | None:
        """The replica for a request with prompt `ids` (counted against it), or None when none is live."""
        live = self.live(now)
        if not live:
            return None
        hashes = block_hashes(ids, self.block)
        chosen = self._longest_prefix(live, hashes)
        if chosen is None:
            chosen = self._rendezvous(live, hashes[0] if hashes else bytes(str(list(ids[:self.block])), "ascii"))
        least = min(live, key=lambda r: (self._replicas[r].score, r))
        c, m = self._replicas[chosen].score, self._replicas[least].score
        if c - m > BALANCE_ABS and c > BALANCE_REL * m:
            chosen = least
        self._record(chosen, hashes)
        return chosen

    def stats(self) -> dict[int, int]:
        """Requests routed to each known replica since it joined."""
        return {rid: r.routed for rid, r in self._replicas.items()}

    def _longest_prefix(self, live: list[int], hashes: list[bytes]) -> int | None:
        best, best_len = None, 0
        for rid in live:
            prefixes = self._replicas[rid].prefixes
            n = 0
            while n < len(hashes) and hashes[n] in prefixes:
                n += 1
            if n > best_len:
                best, best_len = rid, n
        return best

    @staticmethod
    def _rendezvous(live: list[int], key: bytes) -> int:
        return max(live, key=lambda rid: hashlib.blake2b(key + rid.to_bytes(4, "little"), digest_size=8).digest())

    def _record(self, rid: int, hashes: list[bytes]) -> None:
        replica = self._replicas[rid]
        replica.pending += 1
        replica.routed += 1
        for h in hashes:
            replica.prefixes[h] = None
            replica.prefixes.move_to_end(h)
        limit = max(1, replica.load.kv_total_tokens // self.block)  # about what its KV pool can hold
        while len(replica.prefixes) > limit:
            replica.prefixes.popitem(last=False)
