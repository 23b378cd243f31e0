"""Operator routes against the real ring: flush the prefix cache, pause and continue, abort by rid or all,
a health check that generates, and the scheduler's full info. Every test leaves the server running unpaused."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

from tests.server_helpers import ServerHandle, server_info, sse_events, wait_until_idle

CHAT = "/v1/chat/completions"
LONG = {"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 2000,
        "temperature": 0.8, "seed": 1, "ignore_eos": True, "stream": True}


def post(base: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(base + path, json={} if body is None else body, timeout=60)


@pytest.fixture
def base(smollm_server: ServerHandle) -> Iterator[str]:
    """The server's URL; un-pauses it afterwards whatever the test did (the server is shared)."""
    yield smollm_server.base_url
    assert post(smollm_server.base_url, "/continue_generation").json()["success"]
    assert not server_info(smollm_server.base_url)["paused"]


def test_server_info_reports_every_scheduler_field(base: str) -> None:
    info = server_info(base)
    for key in ("kv_running_tokens", "kv_cached_tokens", "num_retractions", "chunked_prefill_size"):
        assert isinstance(info[key], int) and info[key] >= 0
    assert 0.0 <= info["cache_hit_rate"] <= 1.0
    assert info["paused"] is False and isinstance(info["radix_cache"], bool)


def test_flush_cache_drops_cached_prefixes(base: str) -> None:
    assert post(base, CHAT, {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}).is_success
    wait_until_idle(base)
    if server_info(base)["radix_cache"]:
        assert server_info(base)["kv_cached_tokens"] > 0
    reply = post(base, "/flush_cache")
    assert reply.status_code == 200 and reply.json()["success"] is True
    assert server_info(base)["kv_cached_tokens"] == 0


@pytest.mark.parametrize("method, path, kwargs", [
    ("GET", "/flush_cache", {}),  # a link or an <img> on a web page
    ("POST", "/pause_generation", {"data": {"x": "1"}}),  # an HTML form
    ("POST", "/flush_cache", {"content": b"", "headers": {"content-type": "text/plain"}}),  # a no-preflight fetch
    ("POST", "/pause_generation", {}),  # no Content-Type at all
    ("POST", "/abort_request", {"content": b'{"abort_all": true}', "headers": {"content-type": "text/plain"}}),
])
def test_state_changing_routes_take_only_json_posts(base: str, method: str, path: str, kwargs: dict) -> None:
    reply = httpx.request(method, base + path, timeout=30, **kwargs)
    assert reply.status_code in (405, 415), reply.text
    assert reply.json()["error"]["code"] == reply.status_code
    assert not server_info(base)["paused"]


def test_a_rebound_host_name_is_refused(base: str) -> None:
    reply = httpx.post(base + "/pause_generation", json={}, headers={"host": "attacker.example:8000"}, timeout=30)
    assert reply.status_code == 421 and reply.json()["error"]["param"] == "Host"
    assert httpx.get(base + "/v1/models", headers={"host": "attacker.example"}, timeout=30).status_code == 421
    assert not server_info(base)["paused"]
    assert httpx.get(base + "/v1/models", headers={"host": "localhost:1234"}, timeout=30).status_code == 200


def test_unknown_routes_answer_in_openai_shape(base: str) -> None:
    reply = httpx.get(base + "/v1/nothing-here", timeout=30)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == 404


def test_pause_holds_requests_until_continue(base: str) -> None:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    with ThreadPoolExecutor(1) as pool:
        try:
            assert post(base, "/pause_generation").json()["success"] is True
            assert server_info(base)["paused"] is True
            pending = pool.submit(post, base, CHAT, body)
            time.sleep(2.0)
            assert not pending.done(), "a request completed while generation was paused"
        finally:
            assert post(base, "/continue_generation").json()["success"] is True
        reply = pending.result(timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    assert server_info(base)["paused"] is False


def _abort_running_stream(base: str, abort_body: Any, body: dict[str, Any] = LONG) -> tuple[list, httpx.Response]:
    """Start a long stream, call /abort_request after its first chunk (`abort_body(rid)`), read it to the end."""
    with httpx.stream("POST", base + CHAT, json=body, timeout=60) as response:
        events = sse_events(response)
        first = next(events)
        rid = first["id"].removeprefix("chatcmpl-")
        reply = post(base, "/abort_request", abort_body(rid))
        rest = [first, *events]
    return rest, reply


def test_abort_request_by_rid(base: str) -> None:
    events, reply = _abort_running_stream(base, lambda rid: {"rid": rid})
    assert reply.status_code == 200 and reply.json()["success"] is True
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert wait_until_idle(base)["num_running_reqs"] == 0
    bad = post(base, "/abort_request", {"rid": "not.a.rid"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"


def test_aborting_a_rid_that_is_not_live_does_not_refuse_it_later(base: str) -> None:
    assert post(base, "/abort_request", {"rid": "reused-rid-1"}).json()["success"] is True  # nothing live
    reply = post(base, "/generate", {"rid": "reused-rid-1", "text": "Hello",
                                     "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_request_by_rid_aborts_every_choice(base: str) -> None:
    events, reply = _abort_running_stream(base, lambda rid: {"rid": rid}, {**LONG, "n": 2})
    assert reply.json()["success"] is True and len(reply.json()["rids"]) == 3
    finishes = {e["choices"][0]["index"]: e["choices"][0]["finish_reason"] for e in events[:-1]
                if e["choices"] and e["choices"][0]["finish_reason"]}
    assert finishes == {0: "abort", 1: "abort"}
    assert wait_until_idle(base)["num_running_reqs"] == 0


def test_abort_all(base: str) -> None:
    events, reply = _abort_running_stream(base, lambda rid: {"abort_all": True})
    assert reply.status_code == 200 and reply.json()["success"] is True and reply.json()["aborted"] >= 1
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert wait_until_idle(base)["num_running_reqs"] == 0


def test_health_generate(base: str) -> None:
    reply = httpx.get(base + "/health_generate", timeout=60)
    assert reply.status_code == 200 and reply.json() == {"status": "ok"}
