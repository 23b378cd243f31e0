"""Head-of-line blocking over the real ring: a short prompt sent while a long one is prefilled in chunks gets
its first token (and its whole answer) before the long one's first token, instead of waiting for every chunk.

The long prompt (3500 tokens, 32-token chunks, a 32-token step budget: over a hundred steps of prefill) is
caught mid-prefill with /pause_generation, the short one is queued beside it, and generation continues: the
order of the two streams' events then follows from the scheduler's steps alone, not from machine speed.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.server_helpers import ServerHandle, poll_server_info, server_info, sse_events, wait_until_idle
from tests.shared_rings import PREFILL_CHUNK

CHUNK = PREFILL_CHUNK
LONG_LEN = 3500  # the tiny model's context is 4096
DEADLINE = 120.0  # a guard against a hang, not a measured threshold


@pytest.fixture
def server(small_ring: ServerHandle) -> ServerHandle:
    """The small ring (shared with other files, tests/shared_rings.py): `CHUNK`-token prefill chunks and steps."""
    return small_ring


def post(base: str, path: str) -> dict[str, Any]:
    return httpx.post(base + path, json={}, timeout=60).json()




def test_a_short_prompt_is_answered_while_a_long_prompt_is_still_prefilling(server: ServerHandle) -> None:
    base = server.base_url
    assert wait_until_idle(base)["num_running_reqs"] == 0
    events: list[tuple[str, str]] = []  # (request, "first" token | "done"), in the order the client saw them
    lock = threading.Lock()
    errors: list[BaseException] = []

    def stream(name: str, input_ids: list[int]) -> None:
        body = {"input_ids": input_ids, "stream": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
        try:
            with httpx.stream("POST", base + "/generate", json=body, timeout=DEADLINE) as response:
                assert response.status_code == 200, response.read()
                seen_first = False
                for event in sse_events(response):
                    if event == "[DONE]":
                        break
                    if event["output_ids"] and not seen_first:
                        seen_first = True
                        with lock:
                            events.append((name, "first"))
            with lock:
                events.append((name, "done"))
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    long_ids = [100 + (7 * i) % 40000 for i in range(LONG_LEN)]
    short_ids = [200, 300, 400, 500, 600]
    long_thread = threading.Thread(target=stream, args=("long", long_ids))
    short_thread = threading.Thread(target=stream, args=("short", short_ids))
    long_thread.start()
    try:
        poll_server_info(base, lambda i: i["kv_running_tokens"] >= CHUNK, "the long prompt's first chunks", DEADLINE)
        assert post(base, "/pause_generation")["success"] is True
        paused = server_info(base)
        # caught mid-prefill: still waiting (the chunked request), not running, with most of its chunks to go
        assert paused["num_running_reqs"] == 0 and paused["num_waiting_reqs"] == 1, paused
        assert paused["kv_running_tokens"] < LONG_LEN - 8 * CHUNK, paused
        short_thread.start()
        poll_server_info(base, lambda i: i["num_waiting_reqs"] == 2,
                         "the short prompt queued beside the long one", DEADLINE)
    finally:
        assert post(base, "/continue_generation")["success"] is True
    short_thread.join(DEADLINE)
    long_thread.join(DEADLINE)
    assert not errors, errors
    assert ("long", "done") in events and ("short", "done") in events, events
    # the short request's first token, and its last, come before the long one's first token
    assert events.index(("short", "first")) < events.index(("short", "done")) < events.index(("long", "first")), events
    info = wait_until_idle(base)
    assert info["kv_running_tokens"] == 0 and not info["paused"], info
