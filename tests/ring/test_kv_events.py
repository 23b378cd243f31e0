"""The prefix cache's KV events: the block hashes a radix cache reports stored and evicted match a direct
computation over the sequences it holds (through splits, evictions and flushes, randomized too); a real engine
reports a finished request's blocks and a flush's removals; the scheduler's publisher numbers its messages,
splits large ones and answers snapshots over a real NATS server, and two routers fed from it over the bus
agree; the NATS roles may use the new subjects."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from ringserve.actors.engine.scheduling.prefix_cache import NaivePrefixCache, RadixNode, RadixPrefixCache
from ringserve.actors.scheduler.kv_events import KvEventPublisher
from ringserve.actors.tokenizer.router import Router
from ringserve.bus.connection import BusConnection, Delivery
from ringserve.bus.kv_blocks import BLOCK, block_hashes
from ringserve.bus.kv_messages import KvEvents, KvSnapshot
from ringserve.bus.messages import InfoQuery, ReplicaLoad, TokenizedRequest
from ringserve.bus.permissions import role_permissions
from ringserve.bus.subjects import Subjects
from tests.engine_helpers import engine_for, greedy, run_to_completion, tiny_hf_llama

B = 8  # a small block keeps the token lists short; the engine test uses the real BLOCK


def slots(n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def paths(cache: RadixPrefixCache) -> list[list[int]]:
    """Every root-to-leaf token sequence the tree spells."""
    out: list[list[int]] = []

    def walk(node: RadixNode, prefix: list[int]) -> None:
        here = prefix + node.key
        if not node.children and node is not cache.root:
            out.append(here)
        for child in node.children.values():
            walk(child, here)

    walk(cache.root, [])
    return out


def expected_blocks(cache: RadixPrefixCache) -> set[bytes]:
    """The direct computation: the chained hashes of every whole block of every held sequence."""
    return {h for seq in paths(cache) for h in block_hashes(seq, cache.block)}


def drain(cache: RadixPrefixCache, index: set[bytes]) -> tuple[list[bytes], list[bytes]]:
    stored, removed = cache.take_block_events()
    assert not set(stored) & set(removed), "stored and removed are disjoint"
    assert not set(stored) & index, "a block reported stored is new"
    assert set(removed) <= index, "a block reported removed was held"
    index.difference_update(removed)
    index.update(stored)
    return stored, removed


def test_store_split_and_evict_report_the_blocks_of_what_is_held() -> None:
    cache, index = RadixPrefixCache("cpu", block=B), set()
    a = list(range(100, 130))  # 30 tokens: 3 whole blocks
    cache.insert_prefix(a, slots(30))
    stored, removed = drain(cache, index)
    assert stored == block_hashes(a, B) and removed == []
    b = a[:13] + list(range(500, 520))  # shares 13 tokens: splits a's edge inside block 1
    handle, _ = cache.match_prefix(b)
    assert handle.cached_len == 13 and cache.take_block_events() == ([], []), "a split changes no block"
    cache.insert_prefix(b, slots(len(b), 100))
    stored, _ = drain(cache, index)
    assert stored == block_hashes(b, B)[1:], "only the blocks the new branch adds (block 0 is shared)"
    assert index == expected_blocks(cache) == set(cache.held_blocks())
    cache.check_integrity()
    cache.match_prefix(a)  # a is used last: b's branch goes first
    cache.evict(1)
    stored, removed = drain(cache, index)
    assert stored == [] and set(removed) == set(block_hashes(b, B)) - set(block_hashes(a, B))
    assert index == expected_blocks(cache)
    cache.evict(cache.evictable_size)  # a flush
    stored, removed = drain(cache, index)
    assert set(removed) == set(block_hashes(a, B)) and index == set() == set(cache.held_blocks())


def test_a_block_stored_and_evicted_between_reports_is_not_reported() -> None:
    cache = RadixPrefixCache("cpu", block=B)
    ids = list(range(20))
    cache.insert_prefix(ids, slots(20))
    cache.evict(cache.evictable_size)
    assert cache.take_block_events() == ([], [])
    cache.insert_prefix(ids, slots(20))
    first, _ = cache.take_block_events()
    cache.evict(cache.evictable_size)
    cache.insert_prefix(ids, slots(20))  # evicted and stored again: held before and after, no change
    assert cache.take_block_events() == ([], []) and set(cache.held_blocks()) == set(first)
    assert NaivePrefixCache("cpu").take_block_events() == ([], [])


def test_randomized_events_add_up_to_the_direct_computation() -> None:
    rng = random.Random(7)
    cache, index = RadixPrefixCache("cpu", block=B), set()
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    next_slot, handles = 0, []
    for step in range(400):
        op = rng.random()
        ids = rng.choice(stems)[: rng.randrange(1, 31)] + [rng.randrange(50) for _ in range(rng.randrange(0, 25))]
        if op < 0.5:
            cache.insert_prefix(ids, slots(len(ids), next_slot))
            next_slot += len(ids)
        elif op < 0.7:
            handle, _ = cache.match_prefix(ids)
            if rng.random() < 0.5:
                cache.lock(handle)
                handles.append(handle)
        elif op < 0.8 and handles:
            cache.unlock(handles.pop(rng.randrange(len(handles))))
        else:
            cache.evict(rng.randrange(1, 40))
        if step % 7 == 0:
            drain(cache, index)
            assert index == expected_blocks(cache), f"step {step}"
            cache.check_integrity()
    drain(cache, index)
    assert index == expected_blocks(cache) == set(cache.held_blocks())


def test_the_engine_reports_a_finished_requests_blocks_and_a_flushs_removals() -> None:
    engine = engine_for(tiny_hf_llama(), max_total_tokens=2048, max_running_requests=4)
    prompt = [3 + (i * 7) % 500 for i in range(3 * BLOCK + 10)]
    rows = run_to_completion(engine, [TokenizedRequest(rid="a", input_ids=prompt, sampling=greedy(5))])
    output = [t for row in rows["a"] for t in row.token_ids]
    stored, removed = engine.kv_events()
    held = prompt + output[:-1]  # the last sampled token has no KV
    assert stored == block_hashes(held) and removed == []
    assert block_hashes(prompt) == stored[:3], "the router's hashes of the prompt name the same blocks"
    engine.flush_cache()
    assert engine.kv_events() == ([], stored)


class FakeBus:
    """Records publications, with a small max_payload so the publisher splits (only for the numbering test)."""

    max_payload = 4096 + 18 * 10

    def __init__(self) -> None:
        self.sent: list[KvEvents] = []

    async def publish(self, subject: str, msg: KvEvents, traceparent: str | None = None) -> None:
        assert subject == "t.kv.events.3"
        self.sent.append(msg)


def test_the_publisher_numbers_splits_and_mirrors() -> None:
    bus = FakeBus()
    pub = KvEventPublisher(bus, Subjects("t"), 3)  # type: ignore[arg-type]
    hashes = [bytes([i]) * 16 for i in range(25)]
    asyncio.run(pub.publish([], []))
    assert bus.sent == [] and pub.seq == 0, "nothing changed: nothing sent"
    asyncio.run(pub.publish(hashes, []))
    assert [m.seq for m in bus.sent] == [1, 2, 3] and sum(len(m.stored) for m in bus.sent) == 25
    asyncio.run(pub.publish(hashes[20:22], hashes[:5]))
    snap = pub.snapshot()
    assert snap.seq == 4 and snap.epoch == bus.sent[0].epoch and snap.truncated
    newest_first = [21, 20, 24, 23, 22, 19, 18, 17, 16, 15]  # 20 and 21 were stored again last
    assert snap.blocks == [hashes[i] for i in newest_first], "the newest first, one message's worth"


def test_events_over_nats_reach_two_routers_alike_and_a_gap_resyncs(nats_server) -> None:
    async def run() -> None:
        subjects = Subjects("kvt")
        sched = await BusConnection.connect(nats_server.url, "kv-sched")
        tok = await BusConnection.connect(nats_server.url, "kv-tok")
        try:
            cache = RadixPrefixCache("cpu")
            pub = KvEventPublisher(sched, subjects, 1)
            await pub.start()
            routers = [Router(), Router()]
            got = asyncio.Queue()

            async def on_events(events: KvEvents, delivery: Delivery) -> None:
                for router in routers:
                    if router.on_kv_events(events):
                        snap = await tok.request(subjects.kv_snapshot(1), InfoQuery(), KvSnapshot, 2.0)
                        assert not router.on_kv_snapshot(snap)
                await got.put(events.seq)

            await tok.subscribe(subjects.kv_events_any, KvEvents, on_events)
            # two connections: the server must hold both subscriptions before the first publish (a CI run lost it)
            await tok.flush()
            await sched.flush()
            for router in routers:
                for r in (0, 1):
                    router.on_heartbeat(ReplicaLoad(replica=r, interval=0.5, kv_total_tokens=10_000), 0.0)
            prompts = [[p * 1000 + i for i in range(2 * BLOCK + 5)] for p in range(6)]
            for ids in prompts[:3]:
                cache.insert_prefix(ids, slots(len(ids), len(ids) * ids[0] // 1000))
            await pub.publish(*cache.take_block_events())
            assert await asyncio.wait_for(got.get(), 5) == 1
            assert [rt.route(p + [1], 1.0) for rt in routers for p in prompts[:3]] == [1] * 6
            pub.seq += 1  # a message the routers never see
            await pub.publish(*cache.take_block_events())  # (nothing changed: nothing sent)
            cache.evict(cache.evictable_size)
            cache.insert_prefix(prompts[4], slots(len(prompts[4])))
            await pub.publish(*cache.take_block_events())
            assert await asyncio.wait_for(got.get(), 5) == 3
            for router in routers:
                assert router.cached_blocks(1) == set(cache.held_blocks()) == set(block_hashes(prompts[4]))
            assert routers[0].route(prompts[4], 1.0) == routers[1].route(prompts[4], 1.0) == 1
            assert {routers[0].route(p, 1.0) for p in prompts[:3]} == {routers[1].route(p, 1.0) for p in prompts[:3]}
        finally:
            await sched.close()
            await tok.close()

    asyncio.run(run())


@pytest.mark.parametrize("role, publish, subscribe", [
    ("scheduler", "n.kv.events.2", "n.kv.snapshot.2"), ("tokenizer", "n.kv.snapshot.2", "n.kv.events.2")])
def test_the_roles_may_use_the_kv_subjects(role: str, publish: str, subscribe: str) -> None:
    perms = role_permissions("n", role)
    assert any(_matches(p, publish) for p in perms.publish)
    assert any(_matches(p, subscribe) for p in perms.subscribe)


def _matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s))
