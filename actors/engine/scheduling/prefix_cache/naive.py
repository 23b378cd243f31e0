"""The prefix cache used when caching is off: it matches nothing, takes nothing and holds nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ringserve.actors.engine.scheduling.prefix_cache.base import BasePrefixCache, PrefixHandle


@dataclass(eq=False)
class NaiveHandle(PrefixHandle):
    """An empty match; counts its locks only so that unbalanced unlocks fail as they would with radix."""

    locks: int = 0


class NaivePrefixCache(BasePrefixCache):
    """A cache that never caches: every request computes its whole sequence and frees all of its slots."""

    caches = False

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)

    def match_prefix(self, ids: Sequence[int], salt: str | None = None) -> tuple[PrefixHandle, torch.Tensor]:
        return NaiveHandle(cached_len=0), self._empty

    def lock(self, handle: PrefixHandle) -> None:
        _naive(handle).locks += 1

    def unlock(self, handle: PrefixHandle) -> None:
        handle = _naive(handle)
        if handle.locks <= 0:
            raise RuntimeError("unlock of a prefix handle that is not locked")
        handle.locks -= 1

    def insert_prefix(self, ids: Sequence[int], slots: torch.Tensor, salt: str | None = None) -> int:
        return len(ids)

    def evict(self, num_tokens: int) -> torch.Tensor:
        return self._empty

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0

    def check_integrity(self) -> None:
        pass

    def all_slots(self) -> torch.Tensor:
        return self._empty


def _naive(handle: PrefixHandle) -> NaiveHandle:
    if not isinstance(handle, NaiveHandle):
        raise TypeError(f"not a handle of the naive prefix cache: {handle!r}")
    return handle
