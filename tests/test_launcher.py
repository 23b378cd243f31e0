"""`ringserve serve` as a whole: a safetensors model directory, embedded NATS, fail-stop when an actor dies."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server_helpers import REPO, save_tiny_model, start_server


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with a 512-token context (the test reads it back as max_model_len)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama-512"), 512)


def test_bad_model_fails_fast_with_a_message() -> None:
    result = subprocess.run([sys.executable, "-m", "actors.launcher.cli", "serve", "--model", "/no/such/model"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "/no/such/model" in result.stderr


def test_serves_a_safetensors_directory_then_fail_stops_when_an_actor_dies(tiny_model_dir: Path) -> None:
    server = start_server(str(tiny_model_dir))  # no --nats-url: the launcher embeds its own NATS server
    try:
        reply = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4,
                                                                     "temperature": 0}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"] == 512

        outcome: dict[str, object] = {}

        def long_stream() -> None:
            body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
                    for _ in response.iter_lines():
                        pass
                outcome["ended"] = "closed"
            except httpx.HTTPError as exc:
                outcome["ended"] = repr(exc)

        client = threading.Thread(target=long_stream)
        client.start()
        time.sleep(1.0)
        os.kill(server.actor_pids()["scheduler0"], signal.SIGKILL)
        server.proc.wait(timeout=30)
        assert server.proc.returncode == 1
        assert re.search(r"actor scheduler0 \(pid \d+\) exited with code -9", server.log())
        assert server.live_actors() == [], "fail-stop left actor processes running"
        client.join(timeout=30)
        assert not client.is_alive() and "ended" in outcome, "an in-flight request hung after the scheduler died"
    finally:
        server.stop()


def test_the_launcher_fail_stops_when_its_embedded_nats_server_dies(tiny_model_dir: Path) -> None:
    server = start_server(str(tiny_model_dir))
    try:
        found = re.search(r"started nats-server pid=(\d+)", server.log())
        assert found, server.log()[-2000:]
        os.kill(int(found.group(1)), signal.SIGKILL)
        server.proc.wait(timeout=30)
        assert server.proc.returncode == 1
        assert "nats-server" in server.log() and "fail-stop" in server.log()
        assert server.live_actors() == [], "fail-stop left actor processes running"
    finally:
        server.stop()
