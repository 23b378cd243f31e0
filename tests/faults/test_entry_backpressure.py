"""Load above `--max-queued-requests`: the excess gets a fast 503 with Retry-After before touching the bus, the
admitted requests complete, and afterwards every admitted request had its terminal event and no actor holds
per-request state."""

from __future__ import annotations

import threading
import time

import httpx

from tests.server_helpers import ServerHandle, server_info
from tests.shared_rings import QUEUE_CAPACITY

CAPACITY = QUEUE_CAPACITY  # --max-queued-requests of the small ring (shared with other files, tests/shared_rings.py)
CLIENTS = 12
BODY = {"prompt": "Hello", "max_tokens": 150, "ignore_eos": True, "temperature": 0}


def test_load_above_capacity_gets_fast_503s_and_leaves_nothing(small_ring: ServerHandle) -> None:
    base = small_ring.base_url
    httpx.post(base + "/v1/completions", json={**BODY, "max_tokens": 2}, timeout=60)  # warm
    before = server_info(base)
    results: list[tuple[int, float, httpx.Response]] = []
    barrier = threading.Barrier(CLIENTS)

    def client() -> None:
        barrier.wait()
        started = time.monotonic()
        response = httpx.post(base + "/v1/completions", json=BODY, timeout=120)
        results.append((response.status_code, time.monotonic() - started, response))

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert len(results) == CLIENTS
    ok = [r for status, _, r in results if status == 200]
    busy = [(seconds, r) for status, seconds, r in results if status == 503]
    assert len(ok) + len(busy) == CLIENTS, [(s, r.text[:200]) for s, _, r in results]
    assert len(ok) >= CAPACITY and len(busy) >= CLIENTS - 2 * CAPACITY, (len(ok), len(busy))
    assert all(r.json()["usage"]["completion_tokens"] == BODY["max_tokens"] for r in ok)
    for seconds, response in busy:
        assert response.headers.get("retry-after") == "1"
        error = response.json()["error"]
        assert error["type"] == "server_error" and "limit" in error["message"]
        assert seconds < 2.0, f"a rejection took {seconds:.2f} s"

    deadline = time.monotonic() + 10
    while True:  # heartbeats report each actor's per-request state every 0.5 s
        info = server_info(base)
        settled = info["entry_live_requests"] == 0 and all(a["live_rids"] == 0 for a in info["actors"].values())
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert settled, info["actors"]
    assert info["entry_admitted_total"] - before["entry_admitted_total"] == len(ok), info
    assert info["entry_admitted_total"] == info["entry_terminal_total"], info
    # nothing piles up: per-request subscriptions are gone and the entry's memory is flat
    assert info["entry_subscriptions"] == before["entry_subscriptions"], (before, info)
    assert info["entry_rss_bytes"] - before["entry_rss_bytes"] < 32 * 2**20, (before, info)
    assert info["entry_rejected_busy_total"] == len(busy)
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    assert httpx.post(base + "/v1/completions", json={**BODY, "max_tokens": 2}, timeout=60).status_code == 200
