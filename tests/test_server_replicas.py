"""Two scheduler replicas (`--dp 2`) behind one ring, with the real model: both serve, greedy output is what
one replica gives, requests sharing a long prefix land where that prefix is cached, a burst spreads over
both, operator commands reach every replica, and a replica killed under load ends only its own requests
while the other serves on, then comes back."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from actors.common.model_source import DEFAULT_MODEL
from tests.server_helpers import ServerHandle, sse_events, start_server

GREEDY = {"max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def dp_server() -> Iterator[ServerHandle]:
    handle = start_server(DEFAULT_MODEL, extra=["--dp", "2", "--max-total-tokens", "16384"])
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
