"""The prefix-cache interface the engine's cache manager drives, and the handle that names a cached prefix.

A prefix cache maps token-id sequences to the KV-pool slots (one slot per token, int64) that hold their K/V.
It never allocates slots: it takes ownership of slots callers hand it on insert and gives them back on
eviction. It knows nothing about requests; callers pin what they use through handles.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class PrefixHandle:
    """A matched prefix. Opaque to callers except `cached_len`, the number of tokens the match covers.

    A handle stays valid while it is locked; an unlocked handle may go stale once the cache evicts, and
    locking a stale handle raises.
    """

    cached_len: int


class BasePrefixCache(ABC):
    """What every prefix cache offers; see `RadixPrefixCache` and `NaivePrefixCache`."""

    caches: bool = True
    """False when the cache never holds anything (the naive cache), so callers can skip the bookkeeping."""

    @abstractmethod
    def match_prefix(self, ids: Sequence[int], salt: str | None = None) -> tuple[PrefixHandle, torch.Tensor]:
        """The longest cached prefix of `ids` among those inserted with the same `salt` (a request's
        `cache_salt`: salted and unsalted prompts never share a prefix): a handle and its slots
        `[handle.cached_len]` int64.

        Counts as a use of the matched prefix for LRU eviction. May split a radix node.
        """

    @abstractmethod
    def lock(self, handle: PrefixHandle) -> None:
        """Pin the handle's prefix (reference count +1): locked tokens are never evicted."""

    @abstractmethod
    def unlock(self, handle: PrefixHandle) -> None:
        """Undo one `lock`. Raises RuntimeError if the handle is not locked."""

    @abstractmethod
    def insert_prefix(self, ids: Sequence[int], slots: torch.Tensor, salt: str | None = None) -> int:
        """Offer `ids` with their slots (`slots[i]` holds token `ids[i]`; extra trailing slots are ignored),
        under `salt` (see `match_prefix`).

        Returns how many leading tokens of `ids` the cache did not take from `slots`: the length already
        cached before the call, whose slots the cache already holds (the caller frees its own duplicates
        among those). The cache takes ownership of `slots[returned:len(ids)]`.
        """

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Evict least-recently-used unlocked tokens until at least `num_tokens` are freed or none remain.

        Returns the freed slots (int64, possibly more than asked); ownership passes to the caller.
        """

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held and not locked by any handle."""

    @property
    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held and locked by at least one handle."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError with a clear message if the internal state is inconsistent."""

    @abstractmethod
    def all_slots(self) -> torch.Tensor:
        """Every slot the cache holds (int64), for the engine's pool-accounting check."""

    def take_block_events(self) -> tuple[list[bytes], list[bytes]]:
        """The hashes (`ringserve.bus.kv_blocks`) of the whole blocks stored and of those evicted since the last call,
        netted: `(stored, removed)`, disjoint. What the scheduler publishes as KV events; none by default."""
        return [], []

    def held_blocks(self) -> list[bytes]:
        """The hashes of every whole block the cache holds now (what `take_block_events` adds up to)."""
        return []

    def cached_blocks(self) -> Iterator[tuple[bytes, torch.Tensor]]:
        """Every whole block the cache holds as `(hash, slots)`, the most recently used first, each after the
        blocks of its prefix (what a graceful stop saves to the KV tier); none by default."""
        return iter(())
