"""Every admitted request gets exactly one terminal event and no request outlives its reader: killed clients,
a duplicate-rid race, rid reuse, a lost output (sequence gap) and a stalled ring."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ringserve.bus.connection import BusConnection
from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.bus.messages import RequestOutput
from ringserve.bus.subjects import Subjects
from tests.server_helpers import ServerHandle, server_info, sse_events, start_server

STALL_SECONDS = 3.0
LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, nats_server: EmbeddedNatsServer) -> Iterator[ServerHandle]:
    handle = start_server(str(tiny_model_dir), nats_url=nats_server.url,
                          extra=["--max-total-tokens", "16384", "--stall-timeout", str(STALL_SECONDS)])
    yield handle
    handle.stop()


def settled(base: str, timeout: float) -> dict[str, Any]:
    """Poll until no request runs, waits or holds KV and no actor (heartbeats) holds per-request state."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(base)
        done = (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["kv_running_tokens"] == 0
                and info["entry_live_requests"] == 0 and all(a["live_rids"] == 0 for a in info["actors"].values()))
        if done or time.monotonic() > deadline:
            info["settled"] = done
            return info
        time.sleep(0.1)


def raw_stream(base: str, body: dict[str, Any]) -> socket.socket:
    """Start a streamed /generate over a bare socket and return it once the first event arrived."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    received = b""
    while b"data: " not in received:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    return sock


def test_killed_clients_free_kv_and_every_actors_state(server: ServerHandle) -> None:
    base = server.base_url
    baseline = settled(base, 10)
    assert baseline["settled"], baseline
    socks = [raw_stream(base, {"text": f"story {i}", "sampling_params": LONG, "stream": True}) for i in range(16)]
    assert server_info(base)["entry_live_requests"] == 16
    killed = time.monotonic()
    for sock in socks:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        sock.close()
    info = settled(base, 5.0)
    assert info["settled"], f"not back to baseline {time.monotonic() - killed:.1f} s after the kill: {info}"
    assert info["kv_running_tokens"] == baseline["kv_running_tokens"] == 0
    assert info["entry_admitted_total"] == info["entry_terminal_total"]


def test_duplicate_rid_race_admits_exactly_one_and_the_rid_is_reusable(server: ServerHandle) -> None:
    rid = f"dup-{uuid.uuid4().hex[:8]}"
    body = {"text": "Hello", "rid": rid, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    barrier = threading.Barrier(2)
    responses: list[httpx.Response] = []

    def client() -> None:
        with httpx.Client(timeout=60) as http:
            barrier.wait()
            responses.append(http.post(server.base_url + "/generate", json=body))

    threads = [threading.Thread(target=client) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert sorted(r.status_code for r in responses) == [200, 400], [r.text for r in responses]
    ok = next(r for r in responses if r.status_code == 200).json()
    refused = next(r for r in responses if r.status_code == 400).json()["error"]
    assert refused["param"] == "rid" and "already in use" in refused["message"]
    assert len(ok["output_ids"]) == 40  # not mixed with the other request's stream
    again = httpx.post(server.base_url + "/generate", json=body, timeout=60)
    assert again.status_code == 200 and len(again.json()["output_ids"]) == 40


def publish_fake_output(nats_url: str, namespace: str, rid: str, seq: int) -> None:
    async def send() -> None:
        bus = await BusConnection.connect(nats_url, "test-injector")
        await bus.publish(Subjects(namespace).output(rid), RequestOutput(rid=rid, seq=seq, text="INJECTED"))
        await bus.flush()
        await bus.close()

    asyncio.run(send())


def test_a_sequence_gap_ends_the_stream_with_an_error_and_aborts(server: ServerHandle) -> None:
    assert server.nats_url is not None
    rid = f"gap-{uuid.uuid4().hex[:8]}"
    body = {"text": "Once upon a time", "rid": rid, "sampling_params": LONG, "stream": True}
    events: list[Any] = []
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=30) as response:
        for event in sse_events(response):
            events.append(event)
            if len(events) == 2:
                publish_fake_output(server.nats_url, server.namespace, rid, seq=10**6)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and events[-1] == "[DONE]", events[-3:]
    assert errors[0]["error"]["code"] == 503 and "lost output" in errors[0]["error"]["message"]
    assert not any(isinstance(e, dict) and "INJECTED" in e.get("text", "") for e in events)
    info = settled(server.base_url, 5.0)
    assert info["settled"], f"the request ran on after its stream failed: {info}"


def test_a_stalled_stream_ends_with_an_error_within_the_deadline(server: ServerHandle) -> None:
    body = {"text": "Once upon a time", "sampling_params": LONG, "stream": True}
    events: list[Any] = []
    try:
        with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=30) as response:
            for event in sse_events(response):
                events.append(event)
                if len(events) == 1:
                    assert httpx.post(server.base_url + "/pause_generation", json={}, timeout=10).json()["success"]
                    paused = time.monotonic()
        ended = time.monotonic() - paused
    finally:
        httpx.post(server.base_url + "/continue_generation", json={}, timeout=10)
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert "no output" in events[-2]["error"]["message"]
    assert STALL_SECONDS - 0.5 <= ended <= STALL_SECONDS + 2.0, ended
    info = settled(server.base_url, 5.0)
    assert info["settled"], f"the stalled request was not aborted: {info}"
