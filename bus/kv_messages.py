"""Typed wire messages of the prefix-cache events a scheduler replica publishes for the routers: what its cache
stored and evicted (`KvEvents`), and the whole of it on request (`KvSnapshot`), by block hash (bus/kv_blocks.py).
Encoded by `ringserve.bus.codec` as every bus message."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KvEvents:
    """What one scheduler replica's prefix cache stored and evicted, on `{ns}.kv.events.{replica}` (at most one
    message per engine step, none when nothing changed).

    `stored` and `removed` are disjoint lists of block hashes (`bus/kv_blocks.py`: chained hashes of whole
    64-token blocks, so one hash names a whole prefix). `epoch` names the replica's incarnation (a restarted
    replica has a new one and starts empty); `seq` counts its messages from 1 within an epoch, so a receiver
    that sees a gap asks for a `KvSnapshot`. A flush (`/flush_cache`, a weight update) arrives as removals.
    """

    replica: int
    epoch: str
    seq: int
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


@dataclass
class KvSnapshot:
    """Reply to an `InfoQuery` on `{ns}.kv.snapshot.{replica}`: every block hash the replica's prefix cache
    holds after its `KvEvents` number `seq` of `epoch` (the most recently stored first; `truncated` when the
    cache holds more than one message carries, the oldest left out)."""

    replica: int
    epoch: str
    seq: int
    blocks: list[bytes] = field(default_factory=list)
    truncated: bool = False
