"""Two scheduler replicas (`--dp 2`) behind one ring, with the real model: both serve, greedy output is what
one replica gives, requests sharing a long prefix land where that prefix is cached, a burst spreads over
both, operator commands reach every replica, and a replica killed (or stopped) under load ends only its own
requests while the other serves on, then comes back; the routers follow what each replica's prefix cache
reports it holds and evicts."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import signal
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from ringserve.actors.common.model_source import DEFAULT_MODEL
from ringserve.bus.connection import BusConnection, Delivery
from ringserve.bus.credentials import NatsCredentials, load_credentials_file
from ringserve.bus.kv_blocks import BLOCK, block_hashes
from ringserve.bus.kv_messages import KvEvents, KvSnapshot
from ringserve.bus.messages import Accepted, InfoQuery, TokenizedRequest
from ringserve.bus.params import SamplingParams
from ringserve.bus.permissions import inbox_prefix
from ringserve.bus.subjects import Subjects, rendezvous
from tests.server_helpers import ServerHandle, sse_events, start_server

GREEDY = {"max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def dp_server() -> Iterator[ServerHandle]:
    handle = start_server(DEFAULT_MODEL, extra=["--dp", "2", "--max-total-tokens", "16384", "--watchdog-timeout", "5",
                                                "--heartbeat-timeout", "2"])  # a stopped replica: after 2 s
    yield handle
    assert handle.stop() == 0


def complete(server: ServerHandle, prompt: str) -> dict[str, Any]:
    response = httpx.post(server.base_url + "/v1/completions", json={"prompt": prompt, **GREEDY}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def info(server: ServerHandle) -> dict[str, Any]:
    return httpx.get(server.base_url + "/get_server_info", timeout=30).json()


def system_prompt(topic: int) -> str:
    return f"Briefing {topic}. " + " ".join(f"rule {topic}-{i}: keep item {i} dry;" for i in range(30))


def test_the_entry_is_ready_only_once_every_replica_had_a_beat_to_show_up() -> None:
    """/health turns 200 when the entry's wait ends: not at the first scheduler's beat, else `/get_server_info`
    and operator commands right after would count one replica of two."""
    from ringserve.actors.entry.liveness import LivenessMonitor
    from ringserve.bus.messages import Heartbeat, ReplicaLoad

    now = [0.0]
    liveness = LivenessMonitor(clock=lambda: now[0])

    def replica_beat(replica: int) -> Heartbeat:
        return Heartbeat(role="scheduler", rank=replica, pid=10 + replica, interval=0.5,
                         load=ReplicaLoad(replica=replica, interval=0.5))

    async def scenario() -> None:
        for role in ("tokenizer", "detokenizer"):
            liveness.record(Heartbeat(role=role, rank=0, pid=1, interval=0.5))
        liveness.record(replica_beat(1))
        waiting = asyncio.ensure_future(liveness.wait_for_roles(30.0))
        await asyncio.sleep(0.2)
        assert not waiting.done(), "every role beat, but the other replica may not have yet"
        now[0] = 0.4
        liveness.record(replica_beat(0))
        now[0] = 0.7
        await asyncio.wait_for(waiting, 5)

    asyncio.run(scenario())
    assert liveness.replicas_to_ask() == [0, 1]


def test_commands_wait_for_a_replica_busy_for_a_few_beats_not_for_one_gone_or_drained() -> None:
    """A replica whose loop stalled past the loss threshold (a long step on a loaded host) is still asked, so a
    flush or info query right then reaches both; one silent for ASKED_BEATS beats, or one that drained and
    said so, is not waited for."""
    from ringserve.actors.entry.liveness import LivenessMonitor
    from ringserve.bus.messages import Heartbeat, ReplicaLoad
    from ringserve.bus.replica_replies import ASKED_BEATS

    now = [0.0]
    liveness = LivenessMonitor(silence_s=2.0, clock=lambda: now[0])

    def beat(replica: int) -> None:
        liveness.record(Heartbeat(role="scheduler", rank=replica, pid=10 + replica, interval=0.5,
                                  load=ReplicaLoad(replica=replica, interval=0.5)))

    beat(0), beat(1)
    now[0] = 3.0
    beat(0)
    assert liveness.lost() == ["scheduler1"] and liveness.replicas_to_ask() == [0, 1]
    now[0] = ASKED_BEATS * 0.5 + 0.1
    beat(0)
    assert liveness.replicas_to_ask() == [0]
    draining = ReplicaLoad(replica=1, interval=0.5, draining=True)
    liveness.record(Heartbeat(role="scheduler", rank=1, pid=11, interval=0.5, live_rids=2, load=draining))
    assert liveness.replicas_to_ask() == [0, 1], "a replica still draining what it holds is asked"
    liveness.record(Heartbeat(role="scheduler", rank=1, pid=11, interval=0.5, live_rids=0, load=draining))
    assert liveness.replicas_to_ask() == [0], "one that drained is not"

def test_both_replicas_serve_and_report(dp_server: ServerHandle, smollm_server: ServerHandle) -> None:
    replicas = info(dp_server)["replicas"]
    assert [r["id"] for r in replicas] == [0, 1] and all(r["up"] and r["tp_size"] == 1 for r in replicas)
    assert all(r["kv_total_tokens"] == 16384 for r in replicas)
    prompts = [f"Question {i}: name a colour." for i in range(6)]
    for prompt in prompts:  # greedy output does not depend on which replica serves it
        assert complete(dp_server, prompt)["choices"][0]["text"] == complete(smollm_server, prompt)["choices"][0]["text"]


def test_a_shared_prefix_lands_where_it_is_cached(dp_server: ServerHandle) -> None:
    for topic in range(4):
        prefix = system_prompt(topic)
        first = complete(dp_server, prefix + " First question?")
        prefix_tokens = first["usage"]["prompt_tokens"] - 5
        for q in range(3):
            reply = complete(dp_server, prefix + f" Question number {q}?")
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= prefix_tokens - 64, (topic, q, cached, prefix_tokens)
    routed = [r["requests_routed"] for r in info(dp_server)["replicas"]]
    assert min(routed) > 0, f"four distinct prefixes use both replicas: {routed}"


def test_a_burst_spreads_and_commands_reach_every_replica(dp_server: ServerHandle) -> None:
    before = [r["requests_routed"] for r in info(dp_server)["replicas"]]
    prompts = [f"Burst {i}: name an animal." for i in range(16)]  # sixteen distinct prefixes at once
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda p: complete(dp_server, p), prompts))
    assert all(r["choices"][0]["finish_reason"] for r in replies)
    after = [r["requests_routed"] for r in info(dp_server)["replicas"]]
    assert sum(after) - sum(before) == 16 and all(a > b for a, b in zip(after, before)), (before, after)
    flushed = httpx.post(dp_server.base_url + "/flush_cache", json={}, timeout=30)
    assert flushed.status_code == 200 and flushed.json()["success"]
    assert all(r["kv_used_tokens"] == 0 for r in info(dp_server)["replicas"]), "both replicas flushed"


def _stream(server: ServerHandle, prompt: str, started: threading.Event) -> str:
    """Stream a long completion: "done" when it finished, "error" when it ended with an error event."""
    body = {"prompt": prompt, "max_tokens": 160, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as response:
        for event in sse_events(response):
            started.set()
            if event == "[DONE]":
                return "done"
            if "error" in event:
                return "error"
    return "cut"


def test_a_killed_replica_ends_only_its_requests_and_comes_back(dp_server: ServerHandle) -> None:
    prompts = [f"Story {i}: once upon a time" for i in range(8)]
    events = [threading.Event() for _ in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_stream, dp_server, p, e) for p, e in zip(prompts, events)]
        assert all(e.wait(60) for e in events)
        running = {r["id"]: r["num_running_reqs"] for r in info(dp_server)["replicas"]}
        assert running[0] > 0 and running[1] > 0, running
        old_pid = dp_server.actor_pids()["scheduler1"]
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        fresh = complete(dp_server, "A new request after the kill:")  # served by the other replica
        assert fresh["choices"][0]["finish_reason"] == "length"
        outcomes = [f.result(timeout=120) for f in futures]
    assert sorted(set(outcomes)) == ["done", "error"], outcomes
    assert outcomes.count("error") == running[1], "exactly the killed replica's streams end with an error"
    while time.monotonic() - killed_at < 90:  # the launcher starts it again, and it serves
        if dp_server.actor_pids().get("scheduler1") not in (None, old_pid) and 1 in [
                r["id"] for r in info(dp_server)["replicas"]]:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the killed replica did not come back")
    counters = info(dp_server)
    assert counters["entry_admitted_total"] == counters["entry_terminal_total"]
    assert "restarting it" in dp_server.log()


def test_a_weight_update_is_answered_by_every_replica(dp_server: ServerHandle) -> None:
    response = httpx.post(dp_server.base_url + "/update_weights_from_disk", timeout=60,
                          json={"model_path": "/nonexistent/model.gguf"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model_path", response.text
    assert all(r["up"] for r in info(dp_server)["replicas"])


def _as_tokenizer(server: ServerHandle) -> tuple[str, NatsCredentials]:
    """The ring's NATS URL and the tokenizer role's credentials, from the launcher's log."""
    url = re.search(r"started nats-server pid=\d+ url=(\S+)", server.log())
    creds_dir = re.search(r"nats per-role users credentials_dir=(\S+)", server.log())
    assert url and creds_dir, "the launcher logs its NATS URL and the per-role credentials"
    return url.group(1), load_credentials_file(os.path.join(creds_dir.group(1), "tokenizer.json"))


def _generate(server: ServerHandle, ids: list[int]) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    response = httpx.post(server.base_url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _routed_to(server: ServerHandle, ids: list[int]) -> tuple[int, int]:
    """Which replica served a /generate of `ids`, and its cached tokens."""
    before = [r["requests_routed"] for r in info(server)["replicas"]]
    reply = _generate(server, ids)
    after = [r["requests_routed"] for r in info(server)["replicas"]]
    moved = [i for i, (a, b) in enumerate(zip(after, before)) if a != b]
    assert len(moved) == 1, (before, after)
    return moved[0], reply["meta_info"]["cached_tokens"]


def test_the_routers_follow_what_a_replica_caches_and_evicts(dp_server: ServerHandle) -> None:
    ids = [1000 + (i * 37) % 20000 for i in range(5 * BLOCK)]
    blocks = block_hashes(ids)
    home = rendezvous(blocks[0], [0, 1])  # where a router sends this prefix while no replica holds it
    other = 1 - home
    url, creds = _as_tokenizer(dp_server)
    subjects = Subjects(dp_server.namespace)

    async def until_reported(action: Any, stored: bool) -> None:
        """Run `action`, then wait until replica `other` reports the prefix's blocks stored (or removed)."""
        bus = await BusConnection.connect(url, "kv-test", credentials=creds,
                                          inbox_prefix=inbox_prefix(dp_server.namespace, "tokenizer"))
        seen: set[bytes] = set()
        done = asyncio.Event()

        async def on_events(events: KvEvents, delivery: Delivery) -> None:
            seen.update(events.stored if stored else events.removed)
            if set(blocks) <= seen:
                done.set()

        try:
            await bus.subscribe(subjects.kv_events(other), KvEvents, on_events)
            await action(bus)
            await asyncio.wait_for(done.wait(), 60)
            snapshot = await bus.request(subjects.kv_snapshot(other), InfoQuery(), KvSnapshot, 10)  # a resync
            assert (set(blocks) <= set(snapshot.blocks)) == stored and snapshot.seq >= 1
        finally:
            await bus.close()

    async def submit_to_other(bus: BusConnection) -> None:  # behind every router's back, straight to `other`
        request = TokenizedRequest(rid="kv-direct", input_ids=ids, sampling=SamplingParams(max_new_tokens=2))
        accepted = await bus.request(subjects.tokenized_for(other), request, Accepted, 30)
        assert accepted.replica == other

    async def flush(bus: BusConnection) -> None:
        await asyncio.to_thread(httpx.post, dp_server.base_url + "/flush_cache", json={}, timeout=30)

    asyncio.run(until_reported(submit_to_other, stored=True))
    where, cached = _routed_to(dp_server, ids + [7, 8, 9])
    assert where == other and cached >= len(ids) - BLOCK, "the router prefers the replica that reported the prefix"
    asyncio.run(until_reported(flush, stored=False))  # its own eviction (a flush) reported as removals
    where, cached = _routed_to(dp_server, ids + [7, 8, 10])
    assert where == home and cached == 0, "evicted: no preference left, the rendezvous pick"


def _stream_until(server: ServerHandle, prompt: str, started: threading.Event) -> tuple[str, float]:
    """`_stream`, and when it ended (time.monotonic())."""
    outcome = _stream(server, prompt, started)
    return outcome, time.monotonic()


def test_a_stopped_replica_is_detected_ends_only_its_requests_and_is_replaced(dp_server: ServerHandle) -> None:
    prompts = [f"Tale {i}: far away there lived" for i in range(8)]
    events = [threading.Event() for _ in prompts]
    old_pid = dp_server.actor_pids()["scheduler1"]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(_stream_until, dp_server, p, e) for p, e in zip(prompts, events)]
            assert all(e.wait(60) for e in events)
            running = {r["id"]: r["num_running_reqs"] for r in info(dp_server)["replicas"]}
            assert running[0] > 0 and running[1] > 0, running
            os.kill(old_pid, signal.SIGSTOP)  # alive but silent: no heartbeat, no step, no reply
            stopped_at = time.monotonic()
            ended: list[tuple[str, float]] = []
            pending = set(futures)
            while pending and [o for o, _ in ended].count("error") < running[1]:
                done, pending = concurrent.futures.wait(pending, 60, concurrent.futures.FIRST_COMPLETED)
                assert done, f"no stream ended within 60 s of the stop: {ended}"
                ended += [f.result() for f in done]
            fresh = complete(dp_server, "A new request after the stop:")  # at once, served by the other replica
            assert fresh["choices"][0]["finish_reason"] == "length"
            ended += [f.result(timeout=120) for f in pending]
            errors = [at - stopped_at for outcome, at in ended if outcome == "error"]
            assert len(errors) == running[1], f"exactly the stopped replica's streams end with errors: {ended}"
            assert max(errors) < 3.0, f"the stall is detected within 3 s: {errors}"
            assert [o for o, _ in ended].count("done") == len(prompts) - running[1], ended
        waiting_since = time.monotonic()  # (the other replica's streams may have taken long under load)
        while time.monotonic() - waiting_since < 120:  # the watchdog kills it (5 s of silence) and it comes back
            if dp_server.actor_pids().get("scheduler1") not in (None, old_pid) and 1 in [
                    r["id"] for r in info(dp_server)["replicas"] if r["up"]]:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the stopped replica was not replaced")
    finally:
        try:
            os.kill(old_pid, signal.SIGCONT)  # never leave a stopped process behind
        except ProcessLookupError:
            pass
    with pytest.raises(ProcessLookupError):
        os.kill(old_pid, 0)  # the stopped process was killed, not resumed
    assert "stalled" in dp_server.log() and "restarting it" in dp_server.log()
    counters = info(dp_server)
    assert counters["entry_admitted_total"] == counters["entry_terminal_total"]
    assert complete(dp_server, "And one after the restart:")["choices"][0]["finish_reason"] == "length"
