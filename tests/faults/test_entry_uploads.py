"""Slow and abandoned uploads: a body that does not arrive within --body-read-timeout gets 408, and a client that
goes away mid-upload costs one INFO line, not a traceback; the server stays healthy."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.server_helpers import ServerHandle
from tests.shared_rings import BODY_READ_TIMEOUT

READ_TIMEOUT = BODY_READ_TIMEOUT


@pytest.fixture
def upload_server(small_ring: ServerHandle) -> ServerHandle:
    """The small ring (shared with other files, tests/shared_rings.py), with its `--body-read-timeout`."""
    return small_ring


def _partial_upload(server: ServerHandle) -> socket.socket:
    """A connection that sent the headers of a 1000-byte JSON body and 10 bytes of it."""
    url = urlsplit(server.base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n" + b'{"prompt":')
    return sock


def _content_length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].decode(errors="replace").lower()
    lengths = [line.split(":", 1)[1] for line in head.split("\r\n") if line.startswith("content-length:")]
    return int(lengths[0]) if lengths else 0


def test_a_slow_upload_gets_408_in_time(upload_server: ServerHandle) -> None:
    sock = _partial_upload(upload_server)
    started = time.monotonic()
    data = b""
    try:
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
            chunk = sock.recv(4096)  # the head and the body may come in separate packets
            if not chunk:
                break
            data += chunk
    finally:
        sock.close()
    answer = data.decode(errors="replace")
    assert answer.startswith("HTTP/1.1 408"), answer
    assert '"code":408' in answer.replace(" ", "")
    assert time.monotonic() - started < READ_TIMEOUT + 5


def test_clients_gone_mid_upload_log_one_info_line_each(upload_server: ServerHandle) -> None:
    for _ in range(20):
        _partial_upload(upload_server).close()
    time.sleep(1.0)
    log = upload_server.log()
    assert "Traceback" not in log, log[-3000:]
    assert log.count("client went away") >= 1
    assert httpx.get(upload_server.base_url + "/health", timeout=10).status_code == 200
    reply = httpx.post(upload_server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert reply.status_code == 200
