"""Head-of-line through the chat path (issue 53): a 4-token chat sent while a long chat is prefilled in chunks is
answered, all of it, before the long chat's first token. Both pass through the entry, the tokenizer (the long
one's chat template and tokenization included) and the scheduler, as the issue's requests did.

The long chat (about 3,000 tokens, the small ring's 32-token chunks and steps: ~90 steps of prefill) is caught
mid-prefill with /pause_generation and the short one is queued beside it before generation continues, so the
order of the events follows from the scheduler's steps, never from the machine's speed.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.server_helpers import ServerHandle, poll_server_info, server_info, wait_until_idle
from tests.shared_rings import PREFILL_CHUNK

GUARD = 120.0  # against a hang, not a measured threshold


@pytest.fixture
def server(small_ring: ServerHandle) -> ServerHandle:
    """The small ring (tests/shared_rings.py): `PREFILL_CHUNK`-token prefill chunks and steps."""
    return small_ring




def _control(base: str, path: str) -> None:
    assert httpx.post(base + path, json={}, timeout=60).json()["success"] is True


def test_a_short_chat_is_answered_before_a_long_chat_in_prefill_gets_its_first_token(server: ServerHandle) -> None:
    base = server.base_url
    model = httpx.get(base + "/v1/models", timeout=60).json()["data"][0]["id"]
    wait_until_idle(base)
    events: list[tuple[str, str]] = []  # (chat, "first" token | "done"), in the order the client saw them
    lock = threading.Lock()
    errors: list[BaseException] = []

    def chat(name: str, content: str) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=GUARD) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: ") and '"content"' in line and (name, "first") not in events:
                        with lock:
                            events.append((name, "first"))
            with lock:
                events.append((name, "done"))
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    long_chat = threading.Thread(target=chat, args=("long", "Summarise: " + " hello" * 2900))
    short_chat = threading.Thread(target=chat, args=("short", "Hi!"))
    long_chat.start()
    try:
        poll_server_info(base, lambda i: i["kv_running_tokens"] >= PREFILL_CHUNK,
                         "the long chat's first chunks", GUARD)
        _control(base, "/pause_generation")
        paused = server_info(base)
        assert paused["num_running_reqs"] == 0 and paused["num_waiting_reqs"] == 1, paused  # mid-prefill
        assert paused["kv_running_tokens"] < 2900 - 8 * PREFILL_CHUNK, paused
        short_chat.start()
        poll_server_info(base, lambda i: i["num_waiting_reqs"] == 2,
                         "the short chat queued beside the long one", GUARD)
    finally:
        _control(base, "/continue_generation")
    short_chat.join(GUARD)
    long_chat.join(GUARD)
    assert not errors, errors
    assert ("long", "done") in events and ("short", "done") in events, events
    assert events.index(("short", "first")) < events.index(("short", "done")) < events.index(("long", "first")), events
    wait_until_idle(base)
