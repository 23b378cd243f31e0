"""A ring missing an actor answers with an error instead of leaving the client waiting."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from typing import Iterator

import httpx
import pytest

from ringserve.bus.embedded_server import EmbeddedNatsServer, free_port
from tests.server_helpers import REPO

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def spawn(module: str, nats_url: str, namespace: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", module, "--nats-url", nats_url, "--namespace", namespace, *args],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def lonely_entry(nats_server: EmbeddedNatsServer) -> Iterator[tuple[str, str]]:
    """An entry actor on a namespace where no other actor runs yet."""
    namespace, port = f"lonely{uuid.uuid4().hex[:8]}", free_port()
    entry = spawn("ringserve.actors.entry", nats_server.url, namespace, "--port", str(port),
                  "--served-model-name", "SmolLM2-135M-Instruct")
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(base + "/health", timeout=5)
            break
        except httpx.TransportError:
            time.sleep(0.2)
    yield base, namespace
    entry.terminate()
    entry.wait(timeout=30)


def test_no_tokenizer_gives_503_at_once(lonely_entry: tuple[str, str]) -> None:
    base, _ = lonely_entry
    started = time.monotonic()
    response = httpx.post(base + "/v1/chat/completions", json=BODY, timeout=60)
    assert response.status_code == 503 and "no tokenizer" in response.json()["error"]["message"]
    assert time.monotonic() - started < 5
    assert httpx.get(base + "/health", timeout=30).status_code == 503  # no scheduler answers either


def test_no_scheduler_gives_503(lonely_entry: tuple[str, str], nats_server: EmbeddedNatsServer) -> None:
    base, namespace = lonely_entry
    tokenizer = spawn("ringserve.actors.tokenizer", nats_server.url, namespace, "--model", "SmolLM2-135M-Instruct")
    try:
        deadline = time.monotonic() + 120
        while True:
            response = httpx.post(base + "/v1/chat/completions", json=BODY, timeout=60)
            if "no tokenizer" not in response.text or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert response.status_code == 503, response.text
        assert "no scheduler accepted" in response.json()["error"]["message"]
    finally:
        tokenizer.terminate()
        tokenizer.wait(timeout=30)
