"""Request lifecycle across processes: disconnects free KV, plain NATS clients can submit and abort."""

from __future__ import annotations

import asyncio
import socket
import time
from urllib.parse import urlparse

import httpx
import msgpack
import nats

from tests.server_helpers import ServerHandle, server_info, sse_events, wait_until_idle

LONG = {"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 4000,
        "temperature": 0.8, "seed": 1, "ignore_eos": True}


def wait_for_kv_in_use(base_url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = server_info(base_url)
        if info["kv_running_tokens"] > 0:
            return info
        time.sleep(0.05)
    raise AssertionError("the request never started")


def test_stream_disconnect_aborts_and_frees_kv(smollm_server: ServerHandle) -> None:
    base = smollm_server.base_url
    assert wait_until_idle(base)["kv_running_tokens"] == 0
    with httpx.stream("POST", base + "/v1/chat/completions", json={**LONG, "stream": True}, timeout=60) as response:
        events = sse_events(response)
        for _ in range(4):
            next(events)
        busy = server_info(base)
        assert busy["num_running_reqs"] == 1 and busy["kv_running_tokens"] > 0
    # closing the stream disconnects the client; without the abort this request would decode 4000 tokens
    info = wait_until_idle(base, timeout=10)
    assert info["num_running_reqs"] == 0 and info["kv_running_tokens"] == 0, info


def test_non_stream_disconnect_aborts_and_frees_kv(smollm_server: ServerHandle) -> None:
    base = smollm_server.base_url
    url = urlparse(base)
    body = httpx.Request("POST", base + "/v1/chat/completions", json=LONG).read()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for_kv_in_use(base)
    info = wait_until_idle(base, timeout=10)
    assert info["num_running_reqs"] == 0 and info["kv_running_tokens"] == 0, info


def _pack(type_name: str, body: dict) -> bytes:
    """Hand-built wire message: what a client in any language would send, per README.md."""
    return msgpack.packb({"type": type_name, "body": body})


def test_plain_nats_client_submits_streams_and_matches_http(smollm_server: ServerHandle) -> None:
    ns = smollm_server.namespace
    sampling = {"max_new_tokens": 12, "temperature": 0}

    async def scenario() -> list[dict]:
        nc = await nats.connect(smollm_server.nats_url)
        sub = await nc.subscribe(f"{ns}.out.nats-client-1")
        await nc.publish(f"{ns}.req.submit", _pack("GenerateRequest", {
            "rid": "nats-client-1", "text": "The three primary colors are", "sampling": sampling}))
        outputs = []
        while True:
            msg = await sub.next_msg(timeout=60)
            assert msg.headers and msg.headers.get("traceparent", "").startswith("00-")
            envelope = msgpack.unpackb(msg.data)
            assert envelope["type"] == "RequestOutput"
            outputs.append(envelope["body"])
            if envelope["body"]["finish"] or envelope["body"]["error"]:
                break
        await nc.close()
        return outputs

    outputs = asyncio.run(scenario())
    assert outputs[-1]["finish"]["type"] == "length" and outputs[-1]["completion_tokens"] == 12
    http = httpx.post(smollm_server.base_url + "/generate",
                      json={"text": "The three primary colors are", "sampling_params": sampling}, timeout=60).json()
    assert "".join(o["text"] for o in outputs) == http["text"]
    assert [t for o in outputs for t in o["token_ids"]] == http["output_ids"]


def test_plain_nats_client_gets_validation_errors_and_can_abort(smollm_server: ServerHandle) -> None:
    ns = smollm_server.namespace

    async def scenario() -> tuple[dict, dict]:
        nc = await nats.connect(smollm_server.nats_url)
        bad = await nc.subscribe(f"{ns}.out.bad-1")
        await nc.publish(f"{ns}.req.submit", _pack("GenerateRequest", {
            "rid": "bad-1", "text": "hi", "sampling": {"top_k": 2.5}}))
        error = msgpack.unpackb((await bad.next_msg(timeout=30)).data)["body"]
        sub = await nc.subscribe(f"{ns}.out.abort-1")
        await nc.publish(f"{ns}.req.submit", _pack("GenerateRequest", {
            "rid": "abort-1", "text": "hi", "sampling": {"max_new_tokens": 4000, "ignore_eos": True}}))
        await sub.next_msg(timeout=60)  # it is running
        await nc.publish(f"{ns}.abort.abort-1", _pack("AbortRequest", {"rid": "abort-1"}))
        while True:
            body = msgpack.unpackb((await sub.next_msg(timeout=30)).data)["body"]
            if body["finish"]:
                await nc.close()
                return error, body

    error, last = asyncio.run(scenario())
    assert error["error"]["param"] == "top_k" and error["error"]["code"] == 400
    assert last["finish"]["type"] == "abort" and last["completion_tokens"] < 4000
    assert wait_until_idle(smollm_server.base_url)["kv_running_tokens"] == 0
