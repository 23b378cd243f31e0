"""The prefix cache: radix match/insert/split, slot ownership, pins, LRU eviction, integrity, and a randomized
simulation of an allocator and requests checking that every pool slot is accounted for exactly once."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from ringserve.actors.engine.scheduling.prefix_cache import (
    BasePrefixCache, NaivePrefixCache, PrefixHandle, RadixPrefixCache, create_prefix_cache,
)


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def checked(cache: BasePrefixCache) -> BasePrefixCache:
    cache.check_integrity()
    assert cache.evictable_size + cache.protected_size == cache.all_slots().numel()
    return cache


def held(cache: BasePrefixCache) -> list[int]:
    return sorted(cache.all_slots().tolist())


def test_match_insert_and_split() -> None:
    cache = RadixPrefixCache("cpu")
    assert cache.caches
    assert cache.insert_prefix([1, 2, 3, 4, 5], slots(10, 11, 12, 13, 14)) == 0
    checked(cache)

    handle, got = cache.match_prefix([1, 2, 3, 9])
    assert handle.cached_len == 3 and got.tolist() == [10, 11, 12] and got.dtype == torch.int64
    checked(cache)
    # The match ended inside the edge, so the edge was split and the handle pins exactly the 3 tokens.
    cache.lock(handle)
    assert (cache.protected_size, cache.evictable_size) == (3, 2)
    checked(cache)
    cache.unlock(handle)
    assert (cache.protected_size, cache.evictable_size) == (0, 5)

    handle, got = cache.match_prefix(torch.tensor([1, 2, 3, 4, 5, 6]))  # a tensor of ids works too
    assert handle.cached_len == 5 and got.tolist() == [10, 11, 12, 13, 14]
    for ids in ([], [9], [2, 3]):
        handle, got = cache.match_prefix(ids)
        assert handle.cached_len == 0 and got.numel() == 0

    assert cache.insert_prefix([1, 2, 3, 7, 8], slots(20, 21, 22, 23, 24)) == 3
    assert cache.match_prefix([1, 2, 3, 7, 8])[1].tolist() == [10, 11, 12, 23, 24]
    assert cache.match_prefix([1, 2, 3, 4, 5])[1].tolist() == [10, 11, 12, 13, 14]
    assert cache.match_prefix([1, 2, 3, 7])[1].tolist() == [10, 11, 12, 23]
    assert held(checked(cache)) == [10, 11, 12, 13, 14, 23, 24]


def test_insert_returns_present_length_and_takes_only_the_new_suffix() -> None:
    cache = RadixPrefixCache("cpu")
    assert cache.insert_prefix([1, 2, 3], slots(0, 1, 2)) == 0
    offered = slots(5, 6, 7, 8, 9, 99)  # a trailing extra slot is ignored
    assert cache.insert_prefix([1, 2, 3, 4, 5], offered) == 3
    # Slots 5, 6, 7 duplicate what was cached: they stay the caller's to free.
    assert held(checked(cache)) == [0, 1, 2, 8, 9]
    offered[3:] = -1  # the cache copied what it took
    assert cache.match_prefix([1, 2, 3, 4, 5])[1].tolist() == [0, 1, 2, 8, 9]

    # Entirely present, including a prefix ending inside an edge: nothing taken.
    assert cache.insert_prefix([1, 2, 3, 4, 5], slots(40, 41, 42, 43, 44)) == 5
    assert cache.insert_prefix([1, 2, 3, 4], slots(40, 41, 42, 43)) == 4
    assert cache.insert_prefix([], slots()) == 0
    assert held(checked(cache)) == [0, 1, 2, 8, 9]
    assert cache.evictable_size == 5
    with pytest.raises(ValueError):
        cache.insert_prefix([7, 7], slots(1))


def test_locked_prefixes_survive_eviction() -> None:
    cache = RadixPrefixCache("cpu")
    cache.insert_prefix([1, 2, 3, 4], slots(10, 11, 12, 13))
    cache.insert_prefix([1, 2, 5], slots(50, 51, 14))
    handle, _ = cache.match_prefix([1, 2, 3])
    cache.lock(handle)
    cache.lock(handle)
    assert (cache.protected_size, cache.evictable_size) == (3, 2)

    assert sorted(cache.evict(100).tolist()) == [13, 14]
    assert (cache.protected_size, cache.evictable_size) == (3, 0)
    assert cache.evict(1).numel() == 0
    assert cache.match_prefix([1, 2, 3, 4])[1].tolist() == [10, 11, 12]

    cache.unlock(handle)
    assert cache.evict(100).numel() == 0  # still locked once
    cache.unlock(handle)
    assert (cache.protected_size, cache.evictable_size) == (0, 3)
    assert sorted(cache.evict(100).tolist()) == [10, 11, 12]
    assert held(checked(cache)) == []
    with pytest.raises(RuntimeError):
        cache.unlock(handle)


def test_eviction_takes_least_recently_used_first() -> None:
    cache = RadixPrefixCache("cpu")
    cache.insert_prefix([1, 1], slots(0, 1))
    cache.insert_prefix([2, 2, 2], slots(2, 3, 4))
    cache.insert_prefix([3], slots(5))
    cache.match_prefix([1, 1, 7])  # touching [1, 1] makes it the most recent
    assert sorted(cache.evict(1).tolist()) == [2, 3, 4]  # a whole leaf, more than asked
    checked(cache)
    assert cache.evict(1).tolist() == [5]
    assert sorted(cache.evict(1).tolist()) == [0, 1]
    assert cache.evict(1).numel() == 0


def test_eviction_frees_parents_that_become_leaves() -> None:
    cache = RadixPrefixCache("cpu")
    cache.insert_prefix([1, 2, 3], slots(0, 1, 2))
    assert cache.insert_prefix([1, 2, 4], slots(7, 8, 9)) == 2  # [1, 2] becomes an inner node
    assert cache.evict(1).tolist() == [2]  # the older leaf only
    assert checked(cache).evictable_size == 3
    assert sorted(cache.evict(2).tolist()) == [0, 1, 9]  # the other leaf, then its now-childless parent
    assert held(checked(cache)) == [] and cache.evictable_size == 0


def test_stale_handles_cannot_be_locked() -> None:
    cache = RadixPrefixCache("cpu")
    cache.insert_prefix([1, 2], slots(0, 1))
    handle, _ = cache.match_prefix([1, 2])
    cache.evict(2)
    with pytest.raises(RuntimeError):
        cache.lock(handle)
    with pytest.raises(RuntimeError):
        cache.unlock(handle)
    with pytest.raises(TypeError):
        cache.lock(PrefixHandle(cached_len=0))


def test_integrity_check_catches_corruption() -> None:
    cache = RadixPrefixCache("cpu")
    cache.insert_prefix([1, 2, 3], slots(0, 1, 2))
    cache.insert_prefix([4], slots(2))  # a slot the cache already holds
    with pytest.raises(AssertionError, match="more than once"):
        cache.check_integrity()

    cache = RadixPrefixCache("cpu")
    cache.insert_prefix([1, 2, 3], slots(0, 1, 2))
    node = cache.root.children[1]
    node.value = node.value[:2]
    with pytest.raises(AssertionError, match="3 tokens but 2 slots"):
        cache.check_integrity()

    cache = RadixPrefixCache("cpu")
    cache.insert_prefix([1, 2, 3], slots(0, 1, 2))
    cache.root.children[1].lock_ref = 1  # a pin the sizes do not know about
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_a_cache_salt_keeps_its_prefixes_apart() -> None:
    """Prefixes inserted under a salt match only under that salt; their block hashes chain to the salt's seed
    (the router's); an evicted salt's empty tree is forgotten and handles into it go stale."""
    from ringserve.bus.kv_blocks import block_hashes, salt_seed

    cache = RadixPrefixCache("cpu", block=4)
    ids = list(range(1, 11))
    assert cache.insert_prefix(ids, torch.arange(10)) == 0
    assert cache.match_prefix(ids, "tenant-a")[0].cached_len == 0  # the shared tree's prefix is not a's
    assert cache.insert_prefix(ids, torch.arange(10, 20), "tenant-a") == 0
    handle, got = cache.match_prefix(ids, "tenant-a")
    assert handle.cached_len == 10 and got.tolist() == list(range(10, 20))
    assert cache.match_prefix(ids)[1].tolist() == list(range(10))
    stale = cache.match_prefix(ids, "tenant-b")[0]
    assert stale.cached_len == 0
    stored, _ = cache.take_block_events()
    assert set(stored) == set(block_hashes(ids, 4)) | set(block_hashes(ids, 4, salt_seed("tenant-a")))
    checked(cache)
    cache.lock(handle)
    assert held(cache) == list(range(20)) and sorted(cache.evict(100).tolist()) == list(range(10))
    checked(cache)
    cache.unlock(handle)
    assert sorted(cache.evict(100).tolist()) == list(range(10, 20)) and held(cache) == []
    checked(cache)
    with pytest.raises(RuntimeError, match="stale"):
        cache.lock(stale)


def test_naive_cache_holds_nothing() -> None:
    cache = create_prefix_cache(False, "cpu")
    assert isinstance(cache, NaivePrefixCache) and not cache.caches
    assert isinstance(create_prefix_cache(True, "cpu"), RadixPrefixCache)
    assert cache.insert_prefix([1, 2, 3], slots(0, 1, 2)) == 3
    handle, got = cache.match_prefix([1, 2, 3])
    assert handle.cached_len == 0 and got.numel() == 0 and got.dtype == torch.int64
    cache.lock(handle)
    assert (cache.evictable_size, cache.protected_size) == (0, 0)
    assert cache.evict(10).numel() == 0 and cache.all_slots().numel() == 0
    cache.unlock(handle)
    with pytest.raises(RuntimeError):
        cache.unlock(handle)
    checked(cache)


# --- randomized simulation ------------------------------------------------------------------------------


@dataclass
class SimRequest:
    ids: list[int]
    handle: PrefixHandle
    cached: list[int]  # the cache's slots for ids[:handle.cached_len], pinned by the handle
    private: list[int] = field(default_factory=list)  # the request's own slots for the rest of ids


class Sim:
    """A slot allocator and requests driving a radix cache the way the engine's cache manager will."""

    POOL = 48

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.cache = RadixPrefixCache("cpu")
        self.free = list(range(self.POOL))
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> the prefix whose last token's K/V it holds
        self.active: list[SimRequest] = []
        self.templates = [[self.rng.randrange(5) for _ in range(self.rng.randrange(3, 12))] for _ in range(3)]
        self.stats = dict(partial_hits=0, duplicates=0, evicted=0, rematches=0, finished=0)

    def fresh_ids(self) -> list[int]:
        template = self.rng.choice(self.templates)
        tail = [self.rng.randrange(5) for _ in range(self.rng.randrange(1, 8))]
        return template[: self.rng.randrange(len(template) + 1)] + tail

    def release(self, freed: list[int]) -> None:
        for slot in freed:
            del self.kv[slot]  # a later match of it would fail the content check
        self.free.extend(freed)

    def alloc(self, n: int) -> list[int] | None:
        """n free slots, evicting for them if the cache can; None if the pool cannot supply them."""
        short = n - len(self.free)
        if short > 0:
            if self.cache.evictable_size < short:
                return None
            freed = self.cache.evict(short).tolist()
            assert len(freed) >= short
            self.stats["evicted"] += len(freed)
            self.release(freed)
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def compute(self, ids: list[int], start: int, new_slots: list[int]) -> None:
        for i, slot in enumerate(new_slots, start):
            self.kv[slot] = tuple(ids[: i + 1])

    def match(self, ids: list[int]) -> tuple[PrefixHandle, list[int]]:
        handle, got = self.cache.match_prefix(ids)
        got_list = got.tolist()
        assert len(got_list) == handle.cached_len
        for i, slot in enumerate(got_list):
            assert self.kv[slot] == tuple(ids[: i + 1]), f"slot {slot} does not hold prefix {ids[: i + 1]}"
        return handle, got_list

    def start(self) -> None:
        ids = self.fresh_ids()
        handle, cached = self.match(ids)
        if 0 < handle.cached_len < len(ids):
            self.stats["partial_hits"] += 1
        self.cache.lock(handle)  # before allocating: eviction must not take our prefix
        private = self.alloc(len(ids) - handle.cached_len)
        if private is None:
            self.cache.unlock(handle)
            return
        self.compute(ids, handle.cached_len, private)
        self.active.append(SimRequest(ids, handle, cached, private))

    def grow(self, req: SimRequest) -> None:
        extra = [self.rng.randrange(5) for _ in range(self.rng.randrange(1, 4))]
        new = self.alloc(len(extra))
        if new is None:
            return
        start = len(req.ids)
        req.ids = req.ids + extra
        req.private += new
        self.compute(req.ids, start, new)

    def insert(self, req: SimRequest) -> None:
        cached_len = len(req.cached)
        present = self.cache.insert_prefix(req.ids, torch.tensor(req.cached + req.private, dtype=torch.int64))
        assert present >= cached_len  # our own prefix is pinned
        duplicates = req.private[: present - cached_len]
        self.stats["duplicates"] += len(duplicates)
        self.release(duplicates)
        handle, got = self.match(req.ids)
        assert handle.cached_len == len(req.ids)
        assert got[:cached_len] == req.cached and got[present:] == req.private[present - cached_len :]
        self.cache.lock(handle)
        self.cache.unlock(req.handle)
        req.handle, req.cached, req.private = handle, got, []

    def rematch(self, req: SimRequest) -> None:
        length = self.rng.randrange(len(req.ids) + 1)
        handle, got = self.match(req.ids[:length])
        pinned = min(length, len(req.cached))
        assert handle.cached_len >= pinned and got[:pinned] == req.cached[:pinned]
        self.cache.lock(handle)
        self.check()
        self.cache.unlock(handle)
        self.stats["rematches"] += 1

    def finish(self, req: SimRequest, commit: bool) -> None:
        if commit:
            self.insert(req)
        self.release(req.private)
        self.cache.unlock(req.handle)
        self.active.remove(req)
        self.stats["finished"] += 1

    def evict(self) -> None:
        before = self.cache.evictable_size
        want = self.rng.randrange(1, 12)
        freed = self.cache.evict(want).tolist()
        assert len(freed) >= want if before >= want else len(freed) == before
        assert self.cache.evictable_size == before - len(freed)
        self.stats["evicted"] += len(freed)
        self.release(freed)

    def check(self) -> None:
        cache = self.cache
        cache.check_integrity()
        in_cache = cache.all_slots().tolist()
        assert len(in_cache) == cache.evictable_size + cache.protected_size
        private = [slot for req in self.active for slot in req.private]
        assert len(self.free) + cache.evictable_size + cache.protected_size + len(private) == self.POOL
        everywhere = self.free + in_cache + private
        assert sorted(everywhere) == list(range(self.POOL)), "a slot is lost or in two places"
        assert set(self.kv) == set(in_cache) | set(private)
        cached = set(in_cache)
        for req in self.active:
            assert cached.issuperset(req.cached), "a pinned prefix was evicted"

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.3 and len(self.active) < 4:
            self.start()
        elif op < 0.45 and self.active:
            self.grow(self.rng.choice(self.active))
        elif op < 0.6 and self.active:
            self.insert(self.rng.choice(self.active))
        elif op < 0.7 and self.active:
            self.rematch(self.rng.choice(self.active))
        elif op < 0.85 and self.active:
            self.finish(self.rng.choice(self.active), commit=self.rng.random() < 0.8)
        else:
            self.evict()


@pytest.mark.parametrize("seed", range(6))
def test_randomized_requests_keep_every_slot_accounted_for(seed: int) -> None:
    sim = Sim(seed)
    sim.check()
    for _ in range(400):
        sim.step()
        sim.check()
    while sim.active:
        sim.finish(sim.active[0], commit=True)
        sim.check()
    assert sim.cache.protected_size == 0
    sim.release(sim.cache.evict(sim.POOL).tolist())
    sim.check()
    assert sorted(sim.free) == list(range(Sim.POOL)) and sim.cache.all_slots().numel() == 0
    # The run exercised what it is meant to: splits, duplicates handed back, evictions and re-pins.
    assert all(count > 0 for count in sim.stats.values()), sim.stats
