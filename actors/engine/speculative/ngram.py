"""Draftless drafts: the tokens that followed the request's last n tokens where those n tokens occurred before,
in its own prompt and output, or else in a bounded pool of n-grams from requests seen before.

Answers that quote, copy or rework their prompt (code edits, extraction, lists) repeat long runs of it; there
the continuation after the last occurrence of the current suffix is usually what the model writes next.
`NgramIndex` keeps, per request, each n-gram's latest continuation position, updated as tokens arrive (a lookup
is a dictionary read, not a scan); `SharedNgramPool` keeps the `max_n`-grams of finished requests with their
continuation, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class NgramIndex:
    """One request's n-grams (`min_n`..`max_n` tokens) -> where the tokens after their latest occurrence start."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # longest first: a longer match predicts better
        self.after: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are indexed

    def draft(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of `ids`' longest matching suffix."""
        self._index(ids)
        for n in self.sizes:
            if len(ids) > n:
                start = self.after.get(tuple(ids[-n:]))
                if start is not None:
                    return list(ids[start:start + k])
        return []

    def _index(self, ids: Sequence[int]) -> None:
        # n-grams ending at positions < len(ids) - 1 (so each has at least one token after it); the suffix itself
        # is indexed once more tokens follow it
        end = len(ids) - 1
        for stop in range(max(self.indexed, 1), end + 1):
            for n in self.sizes:
                if stop >= n:
                    self.after[tuple(ids[stop - n:stop])] = stop
        self.indexed = max(self.indexed, end + 1)


class SharedNgramPool:
    """`n`-grams of earlier requests -> the `k` tokens that followed them, at most `capacity` entries (LRU)."""

    def __init__(self, n: int, k: int, capacity: int) -> None:
        self.n, self.k, self.capacity = n, k, capacity
        self.entries: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def learn(self, ids: Sequence[int]) -> None:
        """Add every `n`-gram of `ids` that has a continuation (later occurrences win)."""
        n, k = self.n, self.k
        for stop in range(n, len(ids)):
            key = tuple(ids[stop - n:stop])
            self.entries[key] = tuple(ids[stop:stop + k])
            self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def draft(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed `ids`' last `n` tokens in an earlier request."""
        if len(ids) < self.n:
            return []
        key = tuple(ids[-self.n:])
        found = self.entries.get(key)
        if found is None:
            return []
        self.entries.move_to_end(key)
        return list(found[:k])
