"""KV slot ownership: the free list, the prefix cache, and the moves of slots between them and requests.

Every pool slot is in exactly one place: free, held by the prefix cache (evictable, or protected while a
running request uses it), or held privately by one request (its table-row slots past its cached prefix).
`check_integrity` asserts that partition; the engine runs it in tests and when idle.

With a KV tier (`tier`, actors/engine/kv_tier/), blocks the prefix cache evicts are saved there (with write-through,
already when they are cached), a graceful stop saves the blocks still cached (`save_to_tier`), and admitting a
request loads the tier's blocks that continue its cached prefix into free slots, which join the prefix cache
as if computed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ringserve.actors.engine.kv_tier.tier import KVTier
from ringserve.actors.engine.scheduling.prefix_cache import BasePrefixCache
from ringserve.actors.engine.core.request import Req
from ringserve.actors.engine.runner.token_table import TokenTable
from ringserve.bus.kv_blocks import block_hashes, salt_seed
from ringserve.kernels.host_copy import to_device


class CacheManager:
    """Allocates slots (evicting cached prefixes when the free list runs short) and caches requests' KV."""

    def __init__(self, num_slots: int, prefix_cache: BasePrefixCache, table: TokenTable, device: torch.device) -> None:
        self.num_slots = num_slots
        self.prefix_cache = prefix_cache
        self.table = table
        self._free = torch.arange(num_slots, dtype=torch.int64, device=device)
        self.tier: KVTier | None = None

    def use_tier(self, tier: KVTier) -> None:
        """Save evicted blocks to `tier` (and each new cached block, if it writes through) and load from it on
        admission (needs the radix prefix cache)."""
        self.tier = tier
        # the radix cache's hooks; written through, an evicted block is on disk already (unless the bound dropped it)
        self.prefix_cache.on_evict = tier.keep if tier.write_through else tier.save  # type: ignore[attr-defined]
        if tier.write_through:
            self.prefix_cache.on_store = tier.keep  # type: ignore[attr-defined]

    def save_to_tier(self, seconds: float) -> dict[str, Any]:
        """Save the cached prefix blocks to an on-disk tier, most recently used first, within its bound and
        `seconds` (`KVTier.save_cached`); {} without a tier in files (one in memory ends with the process)."""
        if self.tier is None or self.tier.store.directory is None:
            return {}
        return self.tier.save_cached(self.prefix_cache.cached_blocks(), seconds)

    @property
    def num_free(self) -> int:
        return self._free.numel()

    @property
    def available(self) -> int:
        """Slots an allocation can get: free ones plus cached ones no running request uses."""
        return self.num_free + self.prefix_cache.evictable_size

    @property
    def num_cached(self) -> int:
        """Slots held only by the prefix cache (evictable)."""
        return self.prefix_cache.evictable_size

    def allocate(self, n: int) -> torch.Tensor:
        """`n` free slots, evicting least-recently-used cached prefixes if needed."""
        if n > self.num_free:
            self._free = torch.cat([self._free, self.prefix_cache.evict(n - self.num_free)])
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {n} slots, {self.num_free} free (the scheduler checks first)")
        slots, self._free = self._free[:n], self._free[n:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the free list."""
        if slots.numel():
            self._free = torch.cat([self._free, slots])

    def admit(self, req: Req) -> None:
        """Give `req` a table row holding the longest cached prefix of its tokens (locked while it runs).

        At least the last token is left uncached: the forward must compute it to sample the next one (and
        every token whose logits score a prompt logprob still to come, `Req.prefix_limit`).
        """
        assert req.device_len == req.seq_len, "a request is admitted with all its tokens applied"
        handle, slots = self.prefix_cache.match_prefix(req.key_ids(req.prefix_limit), req.cache_key)
        self.prefix_cache.lock(handle)
        req.row = self.table.assign()
        self.table.write(req.row, 0, slots)
        req.prefix_handle, req.prefix_len, req.cached_len = handle, handle.cached_len, handle.cached_len
        if self.tier is not None:
            self._load_from_tier(req, self.tier)

    def _load_from_tier(self, req: Req, tier: KVTier) -> None:
        """Extend `req`'s cached prefix with the tier's blocks that continue it (whole blocks up to its
        `prefix_limit`), handed to the prefix cache. Their slots may evict other cached prefixes, as computing
        those tokens would, but leave one slot per request holding a row (its next token)."""
        b, salt = tier.block, req.cache_key
        first = req.cached_len // b
        hashes = block_hashes(req.key_ids(req.prefix_limit // b * b), b, salt_seed(salt))[first:]
        rows_held = self.table.table.shape[0] - self.table.num_free_rows
        count = min(tier.present(hashes), (self.available - rows_held + req.cached_len - first * b) // b)
        payloads = tier.read(hashes[:count]) if count > 0 else []
        if not payloads:
            return
        end, skip = (first + len(payloads)) * b, req.cached_len - first * b
        slots = self.allocate(end - req.cached_len)
        tier.load(payloads, skip, slots)
        self.table.write(req.row, req.cached_len, slots)
        req.cached_len = end
        self.cache_req(req, finished=False)  # the loaded tokens join the prefix cache, locked for `req`

    def extend(self, req: Req, n: int) -> None:
        """Allocate slots for the next `n` tokens of `req` and advance its `cached_len` past them."""
        self.table.write(req.row, req.cached_len, self.allocate(n))
        req.cached_len += n

    def extend_by_one(self, reqs: list[Req]) -> None:
        """`extend(req, 1)` for every request in `reqs`, as one allocation and one table write."""
        if not reqs:
            return
        slots = self.allocate(len(reqs))
        device = slots.device
        rows, cols = to_device([[r.row for r in reqs], [r.cached_len for r in reqs]], device)  # no host sync
        self.table.table[rows, cols] = slots
        for req in reqs:
            req.cached_len += 1

    def truncate(self, req: Req, cached_len: int) -> None:
        """Free `req`'s slots from token `cached_len` on (the KV of rejected draft tokens) and keep the rest."""
        assert req.prefix_len <= cached_len <= req.cached_len
        self.free(self.table.slots(req.row, req.cached_len, cached_len).clone())
        req.cached_len = cached_len

    def cache_req(self, req: Req, finished: bool) -> None:
        """Offer `req`'s computed tokens to the prefix cache.

        Duplicates of what was cached already are freed. A finished (or aborted, or retracted) request then
        gives up its row and lock; a running one switches its lock to the longer cached prefix and keeps going.
        """
        if not finished and not self.prefix_cache.caches:
            return
        assert req.row is not None
        ids = req.key_ids(req.cached_len)
        slots = self.table.slots(req.row, req.cached_len)
        kept = self.prefix_cache.insert_prefix(ids, slots, req.cache_key)
        self.free(slots[req.prefix_len : kept].clone())
        old = req.prefix_handle
        if finished:
            self.prefix_cache.unlock(old)
            self.table.release(req.row)
            req.row, req.prefix_handle, req.prefix_len, req.cached_len = None, None, 0, 0
            return
        handle, cached = self.prefix_cache.match_prefix(ids, req.cache_key)
        assert handle.cached_len == len(ids), "a just-inserted prefix must match in full"
        self.table.write(req.row, 0, cached)
        self.prefix_cache.lock(handle)
        self.prefix_cache.unlock(old)
        req.prefix_handle, req.prefix_len = handle, handle.cached_len

    def drop_req(self, req: Req) -> None:
        """Free a request's own slots without caching them (its KV may be incomplete), unlock, free its row."""
        assert req.row is not None
        self.free(self.table.slots(req.row, req.cached_len, req.prefix_len).clone())
        self.prefix_cache.unlock(req.prefix_handle)
        self.table.release(req.row)
        req.row, req.prefix_handle, req.prefix_len, req.cached_len = None, None, 0, 0

    def flush(self) -> int:
        """Evict every cached prefix that no running request uses; returns the number of slots freed. Nothing
        flushed goes to the KV tier (a flush is asked for to drop the cache, or before new weights)."""
        hook = getattr(self.prefix_cache, "on_evict", None)
        if hook is not None:
            self.prefix_cache.on_evict = None  # type: ignore[attr-defined]
        try:
            freed = self.prefix_cache.evict(self.prefix_cache.evictable_size)
        finally:
            if hook is not None:
                self.prefix_cache.on_evict = hook  # type: ignore[attr-defined]
        self.free(freed)
        return freed.numel()

    def check_integrity(self, live: Iterable[Req]) -> None:
        """Assert that free, cached and request-owned slots partition the pool, each slot in one place."""
        self.prefix_cache.check_integrity()
        owned = [self.table.slots(r.row, r.cached_len, r.prefix_len) for r in live if r.row is not None]
        everything = torch.cat([self._free, self.prefix_cache.all_slots(), *owned])
        counts = (self.num_free, self.prefix_cache.evictable_size, self.prefix_cache.protected_size,
                  sum(s.numel() for s in owned))
        assert sum(counts) == self.num_slots, (
            f"free {counts[0]} + cached {counts[1]} + protected {counts[2]} + request-owned {counts[3]} "
            f"!= pool {self.num_slots}")
        assert everything.unique().numel() == self.num_slots, "a KV slot is in two places at once"
