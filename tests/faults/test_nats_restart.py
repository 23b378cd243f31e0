"""A NATS outage of 5 s: open streams end explicitly (never hang), every actor reconnects and resubscribes,
and the same ring serves again afterwards without a restart."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from ringserve.bus.embedded_server import EmbeddedNatsServer
from tests.server_helpers import start_server

LONG = {"prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 0}


def test_a_5_second_nats_restart_ends_open_streams_and_the_ring_recovers(tiny_model_dir: Path) -> None:
    nats = EmbeddedNatsServer().start()
    server = start_server(str(tiny_model_dir), nats_url=nats.url, extra=["--max-total-tokens", "8192"])
    try:
        ended: dict[str, object] = {}

        def stream() -> None:
            try:
                with httpx.stream("POST", server.base_url + "/v1/completions", json=LONG, timeout=60) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            ended["last"] = line
                            ended.setdefault("started", time.monotonic())
            except httpx.HTTPError as exc:
                ended["error"] = repr(exc)
            ended["at"] = time.monotonic()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while "started" not in ended and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "started" in ended, server.log()[-2000:]

        nats.stop()
        down_at = time.monotonic()
        time.sleep(5)
        nats.start()
        reader.join(timeout=60)
        assert "at" in ended, "a stream hung through the NATS outage"
        assert '"error"' in str(ended.get("last")), ended  # ended explicitly, not silently truncated

        deadline = time.monotonic() + 30
        health = None
        while time.monotonic() < deadline:
            health = httpx.get(server.base_url + "/health", timeout=5)
            if health.status_code == 200:
                break
            time.sleep(0.5)
        assert health is not None and health.status_code == 200, health.text if health else None
        reply = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        assert server.proc.poll() is None and len(server.live_actors()) == 4, "no actor may have exited"
        assert time.monotonic() - down_at < 90
    finally:
        server.stop()
        nats.stop()
