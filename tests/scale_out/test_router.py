"""The tokenizer's cache-aware router over scheduler replicas: prefix affinity from the replicas' KV events
(stores, evictions, gaps resynced from snapshots, restarts), agreement between tokenizer workers that share
nothing, the load override, and replicas that go silent or drain."""

from __future__ import annotations

import random

from ringserve.actors.tokenizer.router import BALANCE_ABS, BLOCK, Router, block_hashes
from ringserve.bus.kv_messages import KvEvents, KvSnapshot
from ringserve.bus.messages import ReplicaLoad


def load(replica: int, running: int = 0, waiting: int = 0, draining: bool = False, epoch: str = "",
         seq: int = 0) -> ReplicaLoad:
    return ReplicaLoad(replica=replica, interval=0.5, num_running_reqs=running, num_waiting_reqs=waiting,
                       kv_total_tokens=100_000, draining=draining, kv_epoch=epoch, kv_seq=seq)


def events(replica: int, seq: int, stored: list[bytes] = (), removed: list[bytes] = (), epoch: str = "e1") -> KvEvents:
    return KvEvents(replica=replica, epoch=epoch, seq=seq, stored=list(stored), removed=list(removed))


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
    seqs = {0: 0, 1: 0}
    for prefix in range(6):
        first = a.route(prompt(prefix, 0), 1.0)
        assert b.route(prompt(prefix, 0), 1.0) == first, "a new prefix goes where the rendezvous hash says"
        seqs[first] += 1  # the replica caches it and says so, to every worker
        for r in (a, b):
            r.on_kv_events(events(first, seqs[first], block_hashes(prompt(prefix, 0))))
        for suffix in range(1, 4):
            assert a.route(prompt(prefix, suffix), 1.0) == b.route(prompt(prefix, suffix), 1.0) == first
    assert set(a.stats()) == {0, 1} and sum(a.stats().values()) == 24
    assert min(a.stats().values()) > 0, "distinct prefixes spread over both replicas"


def test_the_longest_cached_prefix_wins() -> None:
    r = router(load(0), load(1))
    short = prompt(1, 0, prefix_len=BLOCK)
    where = r.route(short, 1.0)
    other = 1 - where
    r.on_kv_events(events(where, 1, block_hashes(short)))
    long_ids = short[:BLOCK] + list(range(3 * BLOCK))
    r.on_kv_events(events(other, 1, block_hashes(long_ids)))  # the other replica holds a longer prefix
    assert r.route(long_ids + [1, 2, 3], 1.0) == other
    assert r.route(short[:BLOCK] + [9] * BLOCK, 1.0) in (0, 1)


def test_an_eviction_stops_the_preference() -> None:
    r = router(load(0), load(1))
    ids = prompt(4, 0)
    home = r.route(ids, 1.0)
    other = 1 - home
    r.on_kv_events(events(other, 1, block_hashes(ids)))  # cached on the other replica (say, a spilled request)
    assert r.route(ids, 1.0) == other
    r.on_kv_events(events(other, 2, removed=block_hashes(ids)[1:]))  # it evicted all but the first block
    assert r.route(ids, 1.0) == other, "one cached block still beats none"
    r.on_kv_events(events(other, 3, removed=block_hashes(ids)[:1]))
    assert r.cached_blocks(other) == set() and r.route(ids, 1.0) == home, "nothing cached: the rendezvous pick"


def test_a_gap_resyncs_from_the_snapshot_and_keeps_later_events() -> None:
    r = router(load(0), load(1))
    a, b, c = (block_hashes(prompt(p, 0)) for p in (5, 6, 7))
    assert not r.on_kv_events(events(1, 1, a))
    assert r.on_kv_events(events(1, 3, c)), "seq 2 is missing: ask for a snapshot"
    assert not r.on_kv_events(events(1, 4, removed=a[2:])), "one snapshot at a time; later events wait"
    assert r.cached_blocks(1) == set(a), "nothing applied past the gap yet"
    # the snapshot after seq 2 (which stored b); events 3 and 4 are applied on top of it
    assert not r.on_kv_snapshot(KvSnapshot(replica=1, epoch="e1", seq=2, blocks=a + b))
    assert r.cached_blocks(1) == set(a[:2] + b + c)
    assert not r.on_kv_events(events(1, 3, c)), "a duplicate changes nothing"
    assert r.on_kv_events(events(1, 6, [])) and not r.on_kv_snapshot(
        KvSnapshot(replica=1, epoch="e1", seq=5, blocks=b))  # a second gap, a second snapshot
    assert r.cached_blocks(1) == set(b)


def test_a_lost_last_event_is_noticed_by_the_heartbeat_and_a_failed_snapshot_retried() -> None:
    r = router(load(0), load(1))
    r.on_kv_events(events(1, 1, block_hashes(prompt(8, 0))))
    assert not r.on_heartbeat(load(1, epoch="e1", seq=2), 1.0), "seq 2 may still be on its way"
    assert r.on_heartbeat(load(1, epoch="e1", seq=2), 1.5), "a heartbeat later it is lost: resync"
    assert not r.on_heartbeat(load(1, epoch="e1", seq=2), 2.0), "a snapshot is already asked for"
    r.snapshot_failed(1)
    assert r.on_heartbeat(load(1, epoch="e1", seq=2), 2.5), "the next heartbeat asks again"
    r.on_kv_snapshot(KvSnapshot(replica=1, epoch="e1", seq=2, blocks=[]))
    assert not r.on_heartbeat(load(1, epoch="e1", seq=2), 3.0) and r.cached_blocks(1) == set()


def test_a_restarted_replica_starts_empty_and_a_late_joiner_asks_for_a_snapshot() -> None:
    r = router(load(0), load(1))
    ids = prompt(9, 0)
    r.on_kv_events(events(1, 1, block_hashes(ids), epoch="old"))
    assert r.cached_blocks(1) == set(block_hashes(ids))
    assert not r.on_heartbeat(load(1, epoch="new", seq=0), 1.0), "a new incarnation with nothing published yet"
    assert r.cached_blocks(1) == set()
    assert not r.on_kv_events(events(1, 2, block_hashes(ids), epoch="old")), "the old one's late events are stale"
    assert r.cached_blocks(1) == set()
    r.on_kv_events(events(1, 1, block_hashes(ids)[:1], epoch="new"))
    assert r.cached_blocks(1) == set(block_hashes(ids)[:1])
    late = router(load(0))  # a tokenizer that starts while replica 1 has cached and published a lot already
    assert late.on_heartbeat(load(1, epoch="new", seq=7), 1.0)
    late.on_kv_snapshot(KvSnapshot(replica=1, epoch="new", seq=7, blocks=block_hashes(ids)))
    assert late.route(ids, 1.0) == 1


def test_two_routers_fed_the_same_messages_route_alike() -> None:
    rng = random.Random(3)
    a, b = router(load(0), load(1), load(2)), router(load(0), load(1), load(2))
    prompts = [prompt(p, s) for p in range(8) for s in range(3)]
    seqs = [0, 0, 0]
    for step in range(200):
        replica = rng.randrange(3)
        ids = rng.choice(prompts)
        seqs[replica] += 1
        hashes = block_hashes(ids)[: rng.randrange(1, 4)]
        message = events(replica, seqs[replica], *(([], hashes) if rng.random() < 0.3 else (hashes, [])))
        assert a.on_kv_events(message) == b.on_kv_events(message)
        probe = rng.choice(prompts)
        assert a.route(probe, 1.0) == b.route(probe, 1.0), step


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
