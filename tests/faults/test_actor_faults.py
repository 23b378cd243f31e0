"""Actor death and stalls on a real ring (`ringserve serve` of a safetensors directory on its embedded NATS): every
open stream ends with an explicit error within 2 s, the ring fail-stops (no orphan process), also when its
embedded NATS server dies, and a stalled scheduler turns /health to 503 before the watchdog stops all.

Each test leaves its ring stopped, so each has one of its own; the module starts them side by side, which on a
small machine takes less time than starting them one after another."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.server_helpers import ServerHandle, servers_side_by_side

LONG = {"prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 0}
KILLED = ["scheduler0", "detokenizer0", "tokenizer0"]
FLAGS = {**{role: ["--max-total-tokens", "8192"] for role in KILLED}, "stalled": ["--max-total-tokens", "8192",
         "--watchdog-timeout", "6", "--heartbeat-timeout", "2"], "nats": []}  # a stall: after the set silence


@pytest.fixture(scope="module")
def rings(tiny_model_dir: Path) -> Iterator[dict[str, ServerHandle]]:
    """One ring per test (`FLAGS`: the killed actor's role, "stalled", "nats"), started side by side."""
    with servers_side_by_side({name: (str(tiny_model_dir), flags) for name, flags in FLAGS.items()}) as handles:
        yield handles


class StreamWatcher:
    """Reads one long SSE stream in a thread and notes when and how it ended."""

    def __init__(self, server: ServerHandle) -> None:
        self.started = threading.Event()
        self.ended_at: float | None = None
        self.last_event: str = ""
        self.error: str | None = None
        self._thread = threading.Thread(target=self._read, args=(server.base_url,), daemon=True)
        self._thread.start()

    def _read(self, base_url: str) -> None:
        try:
            with httpx.stream("POST", base_url + "/v1/completions", json=LONG, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.started.set()
                        if line != "data: [DONE]":
                            self.last_event = line
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        self.ended_at = time.monotonic()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def open_stream(server: ServerHandle) -> StreamWatcher:
    watcher = StreamWatcher(server)
    assert watcher.started.wait(60), f"the stream never started:\n{server.log()[-2000:]}"
    return watcher


@pytest.mark.parametrize("role", KILLED)
def test_kill_9_of_any_actor_ends_open_streams_with_an_error_and_stops_the_ring(rings: dict[str, ServerHandle],
                                                                               role: str) -> None:
    server = rings[role]
    reply = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4,
                                                                 "temperature": 0}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    models = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"]
    assert models[0]["max_model_len"] == 4096  # read from the directory's config (tests/conftest.py)
    watcher = open_stream(server)
    killed_at = time.monotonic()
    os.kill(server.actor_pids()[role], signal.SIGKILL)
    watcher.join(timeout=30)
    assert watcher.ended_at is not None, "the stream hung after an actor died"
    assert watcher.ended_at - killed_at <= 2.0 + 0.5, f"terminal event after {watcher.ended_at - killed_at:.1f} s"
    assert watcher.error is None and '"error"' in watcher.last_event, watcher.last_event
    assert server.proc.wait(timeout=30) == 1, "an actor's death must fail-stop the ring"
    assert f"actor {role}" in server.log() and "fail-stop" in server.log()
    assert re.search(rf"actor {role} \(pid \d+\) exited with code -9", server.log())
    assert server.live_actors() == [], "fail-stop left actor processes running"


def test_the_launcher_fail_stops_when_its_embedded_nats_server_dies(rings: dict[str, ServerHandle]) -> None:
    server = rings["nats"]
    found = re.search(r"started nats-server pid=(\d+)", server.log())
    assert found, server.log()[-2000:]
    os.kill(int(found.group(1)), signal.SIGKILL)
    server.proc.wait(timeout=30)
    assert server.proc.returncode == 1
    assert "nats-server" in server.log() and "fail-stop" in server.log()
    assert server.live_actors() == [], "fail-stop left actor processes running"


def test_a_stopped_scheduler_fails_streams_turns_health_503_then_the_watchdog_stops_all(
        rings: dict[str, ServerHandle]) -> None:
    server = rings["stalled"]
    scheduler = server.actor_pids()["scheduler0"]
    try:
        watcher = open_stream(server)
        stopped_at = time.monotonic()
        os.kill(scheduler, signal.SIGSTOP)
        watcher.join(timeout=30)
        assert watcher.ended_at is not None and watcher.ended_at - stopped_at <= 2.0 + 1.0
        assert '"error"' in watcher.last_event, watcher.last_event
        health: Any = httpx.get(server.base_url + "/health", timeout=5)
        assert health.status_code == 503, health.text
        assert server.proc.wait(timeout=60) == 1, "the watchdog must fail-stop a stalled ring"
        assert "scheduler0 sent no heartbeat" in server.log()
        assert server.live_actors() == []
    finally:
        try:
            os.kill(scheduler, signal.SIGCONT)
        except ProcessLookupError:
            pass
