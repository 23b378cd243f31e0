"""The tokenizer's cache-aware router over scheduler replicas: prefix affinity, agreement between tokenizer
workers that share nothing, the load override, and replicas that go silent or drain."""

from __future__ import annotations

import random

from actors.tokenizer.router import BALANCE_ABS, BLOCK, Router, block_hashes
from bus.messages import ReplicaLoad


def load(replica: int, running: int = 0, waiting: int = 0, draining: bool = False) -> ReplicaLoad:
    return ReplicaLoad(replica=replica, interval=0.5, num_running_reqs=running, num_waiting_reqs=waiting,
                       kv_total_tokens=100_000, draining=draining)


def router(*loads: ReplicaLoad, now: float = 0.0) -> Router:
    r = Router()
    for item in loads:
        r.on_heartbeat(item, now)
    return r


def prompt(prefix: int, suffix: int, prefix_len: int = 3 * BLOCK) -> list[int]:
    rng = random.Random(prefix)
    head = [rng.randrange(50_000) for _ in range(prefix_len)]
    rng = random.Random(10_000 + suffix)
    return head + [rng.randrange(50_000) for _ in range(20)]


def test_block_hashes_chain_whole_blocks() -> None:
    ids = list(range(2 * BLOCK + 5))
    hashes = block_hashes(ids)
    assert len(hashes) == 2 and block_hashes(ids[:BLOCK]) == hashes[:1]
    assert block_hashes([7] + ids[1:])[1] != hashes[1], "a block's hash depends on everything before it"


def test_a_shared_prefix_keeps_its_replica_and_workers_agree() -> None:
    a, b = router(load(0), load(1)), router(load(0), load(1))  # two tokenizer workers, nothing shared
    for prefix in range(6):
        first = a.route(prompt(prefix, 0), 1.0)
        assert b.route(prompt(prefix, 0), 1.0) == first, "a new prefix goes where the rendezvous hash says"
        for suffix in range(1, 4):
            assert a.route(prompt(prefix, suffix), 1.0) == first
    assert set(a.stats()) == {0, 1} and sum(a.stats().values()) == 24
    assert min(a.stats().values()) > 0, "distinct prefixes spread over both replicas"


def test_the_longest_routed_prefix_wins() -> None:
    r = router(load(0), load(1))
    short = prompt(1, 0, prefix_len=BLOCK)
    where = r.route(short, 1.0)
    other = 1 - where
    long_ids = prompt(1, 0, prefix_len=BLOCK)[:BLOCK] + list(range(3 * BLOCK))
    r._record(other, block_hashes(long_ids))  # the other replica holds a longer prefix of this prompt
    assert r.route(long_ids + [1, 2, 3], 1.0) == other


def test_an_overloaded_replica_spills_to_the_least_loaded() -> None:
    ids = prompt(2, 0)
    home = router(load(0), load(1)).route(ids, 1.0)
    busy = router(load(home, running=BALANCE_ABS + 10), load(1 - home, running=1))
    assert busy.route(ids, 1.0) == 1 - home
    # routed requests count at once: a burst is spread before any heartbeat reports it
    burst = router(load(0), load(1))
    picks = [burst.route(prompt(3, i), 1.0) for i in range(3 * BALANCE_ABS)]
    assert picks.count(0) > 0 and picks.count(1) > 0


def test_silent_and_draining_replicas_get_nothing() -> None:
    r = router(load(0), load(1), now=0.0)
    r.on_heartbeat(load(1), 10.0)
    assert r.live(10.0) == [1] and all(r.route(prompt(p, 0), 10.0) == 1 for p in range(5))
    r.on_heartbeat(load(1, draining=True), 10.5)
    assert r.route(prompt(0, 0), 10.5) is None
    r.forget(1)
    assert r.live(10.5) == []
