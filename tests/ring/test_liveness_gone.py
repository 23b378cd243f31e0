"""A process that is gone is noticed at once, whatever the heartbeat timeout: with `--heartbeat-timeout 60`
and two scheduler replicas, SIGKILL of one ends exactly the streams it held within 2.5 s (the launcher sees the
exit and says so on `{ns}.control.gone`), the other replica's streams finish, and the error names the cause.
Unit: the entry's LivenessMonitor takes the launcher's word for one process only, and ignores its late beats."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from ringserve.actors.entry.liveness import LivenessMonitor
from ringserve.bus.messages import Heartbeat
from tests.server_helpers import ServerHandle, start_server

LONG = {"max_tokens": 1500, "ignore_eos": True, "stream": True, "temperature": 0}


@pytest.fixture(scope="module")
def dp_ring(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(str(tiny_model_dir), extra=["--dp", "2", "--max-total-tokens", "16384",
                                                      "--heartbeat-timeout", "60"])
    yield handle
    handle.stop()


def _stream(server: ServerHandle, prompt: str, started: threading.Event) -> tuple[str, float, str]:
    """Read one long stream: ("done" or "error", when it ended, its last event)."""
    last = ""
    with httpx.stream("POST", server.base_url + "/v1/completions", json={"prompt": prompt, **LONG},
                      timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                started.set()
                last = line
    return ("error" if '"error"' in last else "done"), time.monotonic(), last


def test_a_killed_replica_ends_its_streams_at_once_despite_a_long_heartbeat_timeout(dp_ring: ServerHandle) -> None:
    info = httpx.get(dp_ring.base_url + "/get_server_info", timeout=30).json()
    assert info["heartbeat_timeout"] == 60.0
    prompts = [f"Story {i}: once upon a time" for i in range(8)]
    events = [threading.Event() for _ in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_stream, dp_ring, p, e) for p, e in zip(prompts, events)]
        assert all(e.wait(60) for e in events)
        running = {r["id"]: r["num_running_reqs"] for r in
                   httpx.get(dp_ring.base_url + "/get_server_info", timeout=30).json()["replicas"]}
        assert running[0] > 0 and running[1] > 0, running
        os.kill(dp_ring.actor_pids()["scheduler0"], signal.SIGKILL)
        killed_at = time.monotonic()
        outcomes = [f.result(timeout=120) for f in futures]
    errors = [(at - killed_at, last) for outcome, at, last in outcomes if outcome == "error"]
    assert len(errors) == running[0], f"exactly the killed replica's streams end with an error: {outcomes}"
    assert max(at for at, _ in errors) < 2.5, f"ended {[round(at, 1) for at, _ in errors]} s after the kill"
    assert all("scheduler0" in last and "SIGKILL" in last for _, last in errors), errors[0][1]


def _beat(pid: int) -> Heartbeat:
    return Heartbeat(role="scheduler", rank=0, pid=pid, interval=0.5)


def test_the_launchers_word_ends_one_process_only() -> None:
    now = [0.0]
    liveness = LivenessMonitor(silence_s=10.0, clock=lambda: now[0])
    liveness.record(_beat(100))
    now[0] = 5.0
    assert liveness.lost() == [], "5 s of silence is a busy actor, not a lost one"
    liveness.gone("scheduler", 0, 999, "exited with code 1")  # another process of that name: not this one
    assert liveness.lost() == []
    liveness.gone("scheduler", 0, 100, "exited with code -9: it was killed by SIGKILL (signal 9)")
    assert liveness.lost() == ["scheduler0"] and "SIGKILL" in liveness.why_lost(["scheduler0"])
    liveness.record(_beat(100))  # a beat it sent before it died, read late: no sign of life
    assert liveness.lost() == ["scheduler0"]
    assert liveness.newly_lost() == ["scheduler0"]
    liveness.record(_beat(101))  # its restart beats
    assert liveness.lost() == [] and liveness.live_members("scheduler") == [0]
    now[0] = 16.0
    assert liveness.lost() == ["scheduler0"], "silence past the timeout: lost"
    assert "no heartbeat for 10s" in liveness.why_lost(["scheduler0"])
