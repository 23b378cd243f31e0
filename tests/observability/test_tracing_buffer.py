"""The durable span buffer (`--trace-buffer jetstream` with `--trace-store`): while the collector is down, spans
wait in JetStream; actors flush theirs on shutdown; after a restart of the whole ring (every actor restarted) and
of the collector, every span arrives exactly once. `ringserve trace` prints a request's waterfall from the
running deployment (with the logged trace_exporter credentials) and from the kept store."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from ringserve.actors.launcher.trace_buffer import jetstream_block
from ringserve.actors.launcher.trace_cmd import load_spans
from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.observability.otlp_decode import SpanRecord
from tests.otlp_receiver import OtlpReceiver
from tests.server_helpers import REPO, ServerHandle, start_server


def generate(server: ServerHandle, rid: str) -> None:
    reply = httpx.post(f"{server.base_url}/generate", json={"rid": rid, "text": "Hello there",
                                                            "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert reply.status_code == 200, reply.text


def stored_spans(store: Path, namespace: str) -> list[SpanRecord]:
    """Every span in a stopped deployment's store (read through a temporary nats-server)."""
    import argparse

    args = argparse.Namespace(nats_creds=None, nats_user=None, nats_tls_ca=None, nats_tls_cert=None, nats_tls_key=None)
    with EmbeddedNatsServer(extra_config=jetstream_block(store)) as server:
        return asyncio.run(load_spans(server.url, namespace, args))


def ringserve_trace(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ringserve.actors.launcher.cli", "trace", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def request_trace_ids(spans: list[SpanRecord], rid: str) -> set[str]:
    return {s.trace_id for s in spans if s.attributes.get("ringserve.rid") == rid}


def test_no_span_is_lost_or_duplicated_across_a_collector_outage_and_a_ring_restart(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    store = tmp_path / "trace-store"
    receiver = OtlpReceiver().start()
    flags = ["--trace-store", str(store), "--otlp-endpoint", receiver.url]
    server = start_server(str(tiny_model_dir), extra=flags)
    namespace = server.namespace
    try:
        generate(server, "before")
        receiver.wait_for(lambda spans: any(s.name == "detokenize" and s.attributes.get("ringserve.rid") == "before"
                                            for s in spans))
        receiver.stop()  # the collector goes down
        for i in range(3):
            generate(server, f"during{i}")
        hint = re.search(r"command='ringserve trace RID ([^']+)'", server.log())
        assert hint, server.log()[-2000:]
        live = ringserve_trace("during0", *hint.group(1).split())  # the running deployment's buffer, over NATS
        assert live.returncode == 0, live.stderr
        assert all(name in live.stdout for name in ("POST /generate", "tokenize", "generate", "detokenize"))
        first_pids = {pid for name, pid in server.actor_pids().items() if not name.startswith("trace_exporter")}
    finally:
        assert server.stop() == 0  # every actor flushes its spans into JetStream on the way out
    assert "collector unavailable" in server.log()

    offline = ringserve_trace("during2", "--trace-store", str(store), "--namespace", namespace)
    assert offline.returncode == 0, offline.stderr
    assert re.search(r"trace [0-9a-f]{32}  \d+ spans from 4 processes", offline.stdout), offline.stdout
    assert ringserve_trace("nosuchrid", "--trace-store", str(store), "--namespace", namespace).returncode == 1

    buffered = stored_spans(store, namespace)
    buffered_ids = {s.span_id for s in buffered}
    assert len(buffered_ids) == len(buffered), "JetStream stored a span twice"
    for rid in ("during0", "during1", "during2"):  # spans that never reached the collector are in the buffer
        assert request_trace_ids(buffered, rid) and not request_trace_ids(receiver.snapshot(), rid)

    receiver.start()  # the collector is back, and the ring restarts on the same store: a new exporter resumes
    server = start_server(str(tiny_model_dir), extra=[*flags, "--namespace", namespace])
    try:
        generate(server, "after")
        received = receiver.wait_for(lambda spans: buffered_ids <= {s.span_id for s in spans} and any(
            s.name == "detokenize" and s.attributes.get("ringserve.rid") == "after" for s in spans), timeout=60)
    finally:
        assert server.stop() == 0
    counts = Counter(s.span_id for s in receiver.snapshot())
    assert max(counts.values()) == 1, f"{sum(c > 1 for c in counts.values())} spans arrived twice"
    assert {s.resource["process.pid"] for s in received} >= first_pids  # the first ring's actors' spans survived
    everything = {s.span_id for s in stored_spans(store, namespace)}
    assert {s.span_id for s in receiver.snapshot()} <= everything  # nothing arrived that was not buffered
    for rid in ("before", "during0", "during1", "during2", "after"):
        [trace_id] = request_trace_ids(received, rid)
        processes = {s.process for s in receiver.trace(trace_id)}
        assert len(processes) >= 4, (rid, processes)
