"""Elastic detokenizers: each request goes to one of the live detokenizers (rendezvous hash of its rid, chosen by
the tokenizer and stamped on the request), and with several, one killed under load ends only the streams it
held, with 503 error events within 3 s, while the others complete, new requests are served at once, the
launcher starts it again and it takes new requests; nothing is left behind (admitted == terminal, the scheduler
idle). Unit tests: the rendezvous choice, the placement from heartbeats, the entry's degrade rule, and the
scheduler publishing each request's rows to its stamped detokenizer."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import defaultdict
from typing import Any

import httpx
import pytest

from ringserve.actors.detokenizer.placement import DetokenizerPlacement
from ringserve.actors.entry.liveness import LivenessMonitor
from ringserve.actors.scheduler.actor import SchedulerActor
from ringserve.bus.connection import BusConnection, Delivery
from ringserve.bus.messages import BatchTokenOutput, Heartbeat, TokenizedRequest
from ringserve.bus.params import SamplingParams
from ringserve.bus.subjects import detokenizer_for, new_rid
from tests.faults.test_client_flood import FakeCtx, FakeEngine
from tests.server_helpers import ServerHandle, server_info, wait_until_idle


# --- the choice, its inputs, and the entry's rule -------------------------------------------------------------


def test_the_rendezvous_choice_is_stable_and_moves_little_when_one_joins_or_leaves() -> None:
    rids = [new_rid() for _ in range(3000)]
    before = {rid: detokenizer_for(rid, [0, 1, 2]) for rid in rids}
    assert before == {rid: detokenizer_for(rid, [2, 0, 1]) for rid in rids}  # order and process do not matter
    counts = defaultdict(int)
    for d in before.values():
        counts[d] += 1
    assert all(700 < counts[d] < 1300 for d in (0, 1, 2)), counts
    joined = {rid: detokenizer_for(rid, [0, 1, 2, 7]) for rid in rids}
    moved = [rid for rid in rids if joined[rid] != before[rid]]
    assert all(joined[rid] == 7 for rid in moved), "a new member only takes requests, none move between others"
    assert 450 < len(moved) < 1050, len(moved)  # about a quarter
    left = {rid: detokenizer_for(rid, [0, 2]) for rid in rids}
    assert all(left[rid] == before[rid] for rid in rids if before[rid] != 1), "only the leaver's requests move"


def beat(role: str, rank: int) -> Heartbeat:
    return Heartbeat(role=role, rank=rank, pid=1, interval=0.5)


def test_placement_follows_the_heartbeats() -> None:
    placement = DetokenizerPlacement(range(2))
    rids = [new_rid() for _ in range(200)]
    assert {placement.choose(rid, 0.0) for rid in rids} == {0, 1}  # no beat yet: over the configured ids
    placement.on_heartbeat(beat("detokenizer", 5), 10.0)
    placement.on_heartbeat(beat("scheduler", 3), 10.0)  # other roles are not detokenizers
    assert placement.live(10.0) == [5] and {placement.choose(rid, 10.0) for rid in rids} == {5}
    placement.on_heartbeat(beat("detokenizer", 0), 10.5)
    assert {placement.choose(rid, 10.6) for rid in rids} == {0, 5}
    assert placement.live(11.8) == [0]  # 5 missed three beats: no longer chosen
    assert {placement.choose(rid, 11.8) for rid in rids} == {0}
    placement.on_heartbeat(beat("detokenizer", 5), 12.0)  # back (restarted): chosen again
    assert {placement.choose(rid, 12.0) for rid in rids} == {0, 5}
    assert {placement.choose(rid, 99.0) for rid in rids} == {0, 5}  # none live: among those that beat
    with pytest.raises(ValueError):
        DetokenizerPlacement([])


def test_the_entry_degrades_while_another_detokenizer_beats() -> None:
    now = [0.0]
    liveness = LivenessMonitor(silence_s=2.0, clock=lambda: now[0])
    for role, rank in (("scheduler", 0), ("tokenizer", 0), ("detokenizer", 0), ("detokenizer", 1)):
        liveness.record(beat(role, rank))
    now[0] = 1.5
    for role, rank in (("scheduler", 0), ("tokenizer", 0), ("detokenizer", 0)):
        liveness.record(beat(role, rank))
    now[0] = 2.5  # detokenizer1 silent for 2.5 s, the others for 1 s
    assert liveness.newly_lost() == ["detokenizer1"]
    assert liveness.degraded(["detokenizer1"]) == {"detokenizer": {1}}
    assert liveness.blocking() == [], "the other detokenizer takes new requests"
    assert liveness.is_lost("detokenizer", 1) and not liveness.is_lost("detokenizer", 0)
    assert not liveness.is_lost("detokenizer", None)
    liveness.record(Heartbeat(role="detokenizer", rank=0, pid=2, interval=0.5))  # restarted before it fell silent
    assert liveness.newly_lost() == ["detokenizer0"] and liveness.newly_lost() == []  # its old streams end once
    now[0] = 5.0  # now the last one is silent too: every stream ends, new requests are refused
    assert liveness.degraded(["detokenizer0"]) is None
    assert sorted(liveness.blocking()) == ["detokenizer0", "detokenizer1", "scheduler0"]


def test_the_scheduler_sends_each_requests_rows_to_its_detokenizer_and_forgets_it_at_the_end() -> None:
    async def run() -> None:
        ctx, engine = FakeCtx(), FakeEngine()
        actor = SchedulerActor(ctx, engine)  # type: ignore[arg-type]
        stamped = {"a": 3, "b": 0, "c": 3}
        sampling = SamplingParams(max_new_tokens=4)
        actor._inbox.extend(("add", TokenizedRequest(rid=rid, input_ids=[1], sampling=sampling, detokenizer=d))
                            for rid, d in stamped.items())
        await actor._rows.publish(await actor._apply_inbox())
        await actor._rows.publish([engine.finish("a"), engine.finish("b")])
        actor._inbox.append(("abort", ("c", True)))
        await actor._rows.publish(await actor._apply_inbox())
        sent = [(subject, row.rid) for subject, msg in ctx.bus.published if isinstance(msg, BatchTokenOutput)
                for row in msg.rows]
        assert sorted(sent) == [("t.tokens.0", "b"), ("t.tokens.3", "a"), ("t.tokens.3", "c")]
        assert actor._detokenizer_of == {}, "no state is kept for ended requests"

    asyncio.run(run())


# --- a real ring with two detokenizers --------------------------------------------------------------------------


@pytest.fixture
def two_detokenizers(overlap_shards_server: ServerHandle) -> ServerHandle:
    """SmolLM2 with `--detokenizer-shards 2` (and the overlap loop on), shared with tests/api/test_server_overlap.py:
    the killed detokenizer comes back before the test ends."""
    return overlap_shards_server


class RowWatch:
    """Which detokenizer subject each rid's rows travel on (a plain subscriber on `{ns}.tokens.*`)."""

    def __init__(self, server: ServerHandle) -> None:
        self.server = server
        self.seen: dict[str, set[int]] = defaultdict(set)
        self._bus: BusConnection | None = None

    async def __aenter__(self) -> "RowWatch":
        assert self.server.nats_url is not None
        self._bus = bus = await BusConnection.connect(self.server.nats_url, "detokenizer-watch")

        async def on_rows(batch: BatchTokenOutput, delivery: Delivery) -> None:
            for row in batch.rows:
                self.seen[row.rid].add(int(delivery.subject.rsplit(".", 1)[1]))

        await bus.subscribe(f"{self.server.namespace}.tokens.*", BatchTokenOutput, on_rows)
        await bus.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._bus is not None:
            await self._bus.close()


def rids_for(detokenizer: int, count: int) -> list[str]:
    """`count` fresh rids the two detokenizers' rendezvous gives to `detokenizer`."""
    out: list[str] = []
    while len(out) < count:
        rid = new_rid()
        if detokenizer_for(rid, [0, 1]) == detokenizer:
            out.append(rid)
    return out


async def generate(client: httpx.AsyncClient, rid: str, tokens: int = 8) -> dict[str, Any]:
    body = {"rid": rid, "text": f"Tell me about {rid[:4]}.",
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}
    response = await client.post("/generate", timeout=120, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def stream(client: httpx.AsyncClient, rid: str, tokens: int, started: asyncio.Event) -> tuple[str, float]:
    """("done" | "error" | "cut", monotonic time of the last event) of a streamed /generate."""
    body = {"rid": rid, "text": f"Story {rid[:4]}: once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    async with client.stream("POST", "/generate", json=body, timeout=300) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            started.set()
            payload = line[len("data: "):]
            if payload == "[DONE]":
                return "done", time.monotonic()
            if "error" in json.loads(payload):
                return "error", time.monotonic()
    return "cut", time.monotonic()


def test_requests_spread_over_both_detokenizers(two_detokenizers: ServerHandle) -> None:
    async def run() -> dict[str, set[int]]:
        async with RowWatch(two_detokenizers) as watch:
            async with httpx.AsyncClient(base_url=two_detokenizers.base_url) as client:
                rids = [new_rid() for _ in range(12)]
                await asyncio.gather(*(generate(client, rid) for rid in rids))
            return {rid: watch.seen[rid] for rid in rids}

    seen = asyncio.run(run())
    assert all(seen[rid] == {detokenizer_for(rid, [0, 1])} for rid in seen), seen  # all its rows on one subject
    assert {d for ds in seen.values() for d in ds} == {0, 1}, "both detokenizers get requests"
    actors = server_info(two_detokenizers.base_url)["actors"]
    assert {"detokenizer0", "detokenizer1"} <= actors.keys()


def test_a_killed_detokenizer_ends_only_its_streams_and_comes_back(two_detokenizers: ServerHandle) -> None:
    server = two_detokenizers
    old_pid = server.actor_pids()["detokenizer1"]
    theirs, ours = rids_for(1, 3), rids_for(0, 3)  # the killed one's run long: an abort must stop them

    async def run() -> dict[str, Any]:
        async with RowWatch(server) as watch:
            async with httpx.AsyncClient(base_url=server.base_url) as client:
                started = {rid: asyncio.Event() for rid in theirs + ours}
                tasks = {rid: asyncio.create_task(stream(client, rid, 3000 if rid in theirs else 200, started[rid]))
                         for rid in theirs + ours}
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 120)
                assert not any(t.done() for t in tasks.values()), "every stream runs at the kill"
                os.kill(old_pid, signal.SIGKILL)
                killed_at = time.monotonic()
                fresh = await generate(client, rids_for(0, 1)[0])  # the other detokenizer serves at once
                assert fresh["meta_info"]["finish_reason"]["type"] in ("length", "stop"), fresh
                outcomes = {rid: await task for rid, task in tasks.items()}
                # the entry noticed: the tokenizers no longer choose the dead one, even for its rids
                after = rids_for(1, 3)
                await asyncio.gather(*(generate(client, rid) for rid in after))
                return {"killed_at": killed_at, "outcomes": outcomes, "after": {rid: watch.seen[rid] for rid in after}}

    result = asyncio.run(run())
    outcomes, killed_at = result["outcomes"], result["killed_at"]
    assert {rid: outcomes[rid][0] for rid in theirs} == {rid: "error" for rid in theirs}, outcomes
    assert all(outcomes[rid][1] - killed_at < 3.0 for rid in theirs), (killed_at, outcomes)
    assert {rid: outcomes[rid][0] for rid in ours} == {rid: "done" for rid in ours}, outcomes
    assert all(len(seen) == 1 for seen in result["after"].values()), result["after"]
    info = wait_until_idle(server.base_url, timeout=30)  # the aborts reached the scheduler: nothing runs on
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0, info
    assert info["entry_admitted_total"] == info["entry_terminal_total"], info

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # the launcher starts it again; it beats, so it is chosen again
        actor = server_info(server.base_url)["actors"].get("detokenizer1", {})
        if actor.get("pid") not in (None, old_pid) and actor["age_s"] < 1.5:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"detokenizer1 did not come back:\n{server.log()[-3000:]}")
    assert "restarting it" in server.log()

    async def back() -> dict[str, set[int]]:
        async with RowWatch(server) as watch:
            async with httpx.AsyncClient(base_url=server.base_url) as client:
                rids = rids_for(1, 3)
                await asyncio.gather(*(generate(client, rid) for rid in rids))
            return {rid: watch.seen[rid] for rid in rids}

    time.sleep(1.0)  # every tokenizer has heard its beat
    assert all(seen == {1} for seen in asyncio.run(back()).values()), "the restarted detokenizer serves its rids"
    info = server_info(server.base_url)
    assert info["entry_admitted_total"] == info["entry_terminal_total"], info
