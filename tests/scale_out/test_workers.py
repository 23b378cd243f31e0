"""`ringserve worker`: a ring of single-actor workers on an existing NATS with per-role users (no launcher), with
the real model and real HTTP. It serves; a scheduler started later joins as a second replica and takes traffic,
and one with a live replica's id is refused; a second entry serves the same namespace; SIGTERM of an entry
mid-stream lets the stream finish, unless `--drain-timeout` ends it first; SIGINT of a scheduler under load
drains it (no request fails, exit 0, later requests go to the other replica). And `ringserve serve` still stops
at once when idle, and drains a running stream; a second Ctrl-C stops it at once."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ringserve.actors.launcher.nats_auth import DeploymentAuth, generate_auth
from ringserve.bus.embedded_server import EmbeddedNatsServer, free_port
from tests.server_helpers import REPO, sse_events, start_server

GREEDY = {"max_tokens": 8, "temperature": 0}


@dataclass
class Worker:
    """One `ringserve worker` process and its log."""

    role: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 40.0) -> int:
        """Signal it and wait for its exit code (killed, and the test fails, if it does not exit in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"{self.role} worker did not exit within {timeout}s:\n{self.log()[-3000:]}")
        return self.proc.returncode

    def exited(self, timeout: float) -> int:
        """Its exit code, once it exits on its own (killed, and the test fails, after `timeout` seconds)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.role} worker did not exit within {timeout}s:\n{self.log()[-3000:]}")


def start_worker(nats_url: str, namespace: str, role: str, *flags: str) -> Worker:
    """Start `ringserve worker --role ROLE` (not waiting for it to be ready)."""
    log_path = Path(tempfile.mkstemp(prefix=f"ringserve-worker-{role}-", suffix=".log")[1])
    argv = [sys.executable, "-m", "ringserve.actors.launcher.cli", "worker", "--role", role, "--nats-url", nats_url,
            "--namespace", namespace, *flags]
    if role in ("scheduler", "tokenizer"):  # no warm grammar compile workers (~200 MB each) for these rings
        argv.append("--no-grammar-warm-up")
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    return Worker(role, proc, log_path)


def wait_ready(worker: Worker, timeout: float = 300.0) -> Worker:
    """Wait for the worker's `ready` log line; raises with its log if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "] ready role=" in worker.log():
            return worker
        if worker.proc.poll() is not None:
            raise RuntimeError(f"{worker.role} worker exited with {worker.proc.returncode}:\n{worker.log()[-3000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"{worker.role} worker not ready after {timeout}s:\n{worker.log()[-3000:]}")


@dataclass
class WorkerRing:
    """The module's ring: NATS with per-role users, one tokenizer, one detokenizer, scheduler replica 0 and
    entry A, each worker with its role's credentials file."""

    nats_url: str
    namespace: str
    auth: DeploymentAuth
    base_url: str
    workers: dict[str, Worker]
    entry_b_url: str = ""

    def start(self, role: str, *flags: str) -> Worker:
        return start_worker(self.nats_url, self.namespace, role, *self.auth.actor_args(role), *flags)


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerRing]:
    namespace = f"w{uuid.uuid4().hex[:10]}"
    auth = generate_auth(namespace, tmp_path_factory.mktemp("worker-auth") / "creds")  # as `ringserve nats-config`
    with EmbeddedNatsServer(extra_config=auth.authorization()) as nats:
        port = free_port()
        r = WorkerRing(nats.url, namespace, auth, f"http://127.0.0.1:{port}", {})
        for name, role, flags in (("tokenizer", "tokenizer", ()), ("detokenizer", "detokenizer", ()),
                                  ("scheduler0", "scheduler", ("--max-total-tokens", "16384")),
                                  ("entryA", "entry", ("--port", str(port)))):
            r.workers[name] = r.start(role, *flags)
        try:
            for worker in r.workers.values():
                wait_ready(worker)
            wait_healthy(r.base_url)
            yield r
        finally:
            codes = {name: w.stop() for name, w in r.workers.items()}
            assert all(code == 0 for code in codes.values()), codes


def wait_healthy(base_url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base_url}/health not 200 within {timeout}s")


def complete(base_url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    response = httpx.post(f"{base_url}/v1/completions", json={"prompt": prompt, **GREEDY, **extra}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def replicas(base_url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{base_url}/get_server_info", timeout=30).json()["replicas"]


def stream_outcome(base_url: str, prompt: str, tokens: int,
                   started: threading.Event | None = None) -> tuple[str, str, dict[str, Any] | None]:
    """Stream a completion of exactly `tokens` tokens to its end: (text, finish_reason, the error event or None)."""
    body = {"prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0, "stream": True}
    text, finish = "", ""
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for event in sse_events(response):
            if event == "[DONE]":
                return text, finish, None
            if "error" in event:
                return text, finish, event["error"]
            choice = event["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            if started is not None:
                started.set()
    raise AssertionError("the stream ended without [DONE] or an error event")


def stream_text(base_url: str, prompt: str, tokens: int, started: threading.Event | None = None) -> tuple[str, str]:
    """`stream_outcome` of a stream that must succeed: (text, finish_reason)."""
    text, finish, error = stream_outcome(base_url, prompt, tokens, started)
    assert error is None, error
    return text, finish


def second_entry(ring: WorkerRing) -> str:
    """The base URL of entry B, a second entry worker on its own port (started unless it runs)."""
    if "entryB" not in ring.workers:
        port = free_port()
        ring.workers["entryB"] = wait_ready(ring.start("entry", "--port", str(port)))
        ring.entry_b_url = f"http://127.0.0.1:{port}"
        wait_healthy(ring.entry_b_url)
    return ring.entry_b_url


def test_a_ring_of_workers_serves_http(ring: WorkerRing) -> None:
    reply = complete(ring.base_url, "The capital of France is")
    assert reply["choices"][0]["text"] and reply["choices"][0]["finish_reason"] == "length"
    assert [r["id"] for r in replicas(ring.base_url)] == [0]


def test_a_second_entry_serves_the_same_namespace(ring: WorkerRing) -> None:
    entry_b = second_entry(ring)
    prompts = [f"Question {i}: name a fruit that is" for i in range(4)]
    expected = {p: complete(ring.base_url, p)["choices"][0]["text"] for p in prompts}
    jobs = [(url, p) for p in prompts for url in (ring.base_url, entry_b)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda job: complete(*job)["choices"][0]["text"], jobs))
    assert texts == [expected[p] for _, p in jobs]


def test_sigterm_of_an_entry_lets_its_open_stream_finish(ring: WorkerRing) -> None:
    url = second_entry(ring)
    entry_b = ring.workers.pop("entryB")
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream_text, url, "Tell me a long story about a dragon.", 48, started)
        assert started.wait(60), "the stream did not start"
        entry_b.proc.send_signal(signal.SIGTERM)
        refused = None
        while streaming.running() and refused is None:  # while it drains, new requests get a 503
            answer = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", **GREEDY}, timeout=30)
            if answer.status_code == 503:
                refused = answer
        text, finish = streaming.result(timeout=120)
    assert finish == "length" and text
    assert entry_b.exited(timeout=30) == 0
    assert refused is not None, "no request was refused while the entry drained its stream"
    assert "shutting down" in refused.json()["error"]["message"] and refused.headers.get("retry-after") == "1"
    assert "draining" in entry_b.log() and "drained" in entry_b.log()
    complete(ring.base_url, "Entry A still serves")


def test_the_drain_timeout_ends_what_is_still_open(ring: WorkerRing) -> None:
    port = free_port()
    entry_c = wait_ready(ring.start("entry", "--port", str(port), "--drain-timeout", "1"))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream_outcome, url, "Write a very long essay.", 2000, started)
        assert started.wait(60), "the stream did not start"
        entry_c.proc.send_signal(signal.SIGTERM)
        _, _, error = streaming.result(timeout=20)  # liveness: ended by the timeout, not run to its end
    assert error is not None and "shutting down" in error["message"], error
    assert entry_c.exited(timeout=20) == 0
    assert "drain timed out" in entry_c.log()


def test_a_scheduler_with_a_live_replicas_id_is_refused(ring: WorkerRing) -> None:
    clash = ring.start("scheduler", "--dp-replica-id", "0")
    try:
        clash.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        clash.stop(signal.SIGKILL)
        raise AssertionError(f"a scheduler with a live replica's id started:\n{clash.log()[-2000:]}")
    assert clash.proc.returncode == 2
    assert "scheduler replica 0 is already claimed by a live replica" in clash.log()


def second_replica(ring: WorkerRing) -> Worker:
    """Scheduler replica 1, a worker started after the ring (unless it runs), once the entry lists it."""
    if "scheduler1" not in ring.workers:
        ring.workers["scheduler1"] = wait_ready(ring.start("scheduler", "--dp-replica-id", "1",
                                                           "--max-total-tokens", "16384"))
    deadline = time.monotonic() + 20
    while [r["id"] for r in replicas(ring.base_url)] != [0, 1]:
        assert time.monotonic() < deadline, replicas(ring.base_url)
        time.sleep(0.2)
    return ring.workers["scheduler1"]


def test_a_scheduler_started_later_joins_and_gets_traffic(ring: WorkerRing) -> None:
    second_replica(ring)
    prompts = [f"Burst {i}: name an animal that" for i in range(12)]  # distinct prefixes spread by hash
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: complete(ring.base_url, p), prompts))
    routed = {r["id"]: r["requests_routed"] for r in replicas(ring.base_url)}
    assert routed[1] > 0, routed


def test_sigint_drains_a_scheduler_without_losing_a_request(ring: WorkerRing) -> None:
    second_replica(ring)
    scheduler1 = ring.workers.pop("scheduler1")
    prompts = [f"Story {i}: once upon a time a knight" for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(stream_text, ring.base_url, p, 24) for p in prompts]
        deadline = time.monotonic() + 60
        while not any(r["id"] == 1 and r["num_running_reqs"] > 0 for r in replicas(ring.base_url)):
            assert time.monotonic() < deadline, "replica 1 never ran one of the streams"
            time.sleep(0.1)
        scheduler1.proc.send_signal(signal.SIGINT)
        during = [pool.submit(complete, ring.base_url, f"During the drain {i}:") for i in range(4)]
        results = [s.result(timeout=180) for s in streams]
        assert all(finish == "length" and text for text, finish in results), results
        assert all(d.result(timeout=180)["choices"][0]["finish_reason"] for d in during)
    assert scheduler1.exited(timeout=60) == 0
    log = scheduler1.log()
    assert "draining" in log and "drained" in log and "drain timed out" not in log
    deadline = time.monotonic() + 20
    while [r["id"] for r in replicas(ring.base_url)] != [0]:
        assert time.monotonic() < deadline, replicas(ring.base_url)
        time.sleep(0.2)
    assert "actor heartbeat lost" not in ring.workers["entryA"].log(), "a drained replica left; it was not lost"
    before = replicas(ring.base_url)[0]["requests_routed"]
    for i in range(3):
        complete(ring.base_url, f"After the drain {i}:")
    assert replicas(ring.base_url)[0]["requests_routed"] == before + 3


def test_serve_stops_at_once_when_idle_and_drains_a_running_stream(tiny_model_dir: Path) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two rings, started side by side
        idle, busy = pool.map(lambda _: start_server(str(tiny_model_dir)), range(2))
    idle.proc.send_signal(signal.SIGINT)
    idle.proc.wait(timeout=5)  # liveness: nothing to drain, so no grace period is waited out
    assert idle.proc.returncode == 0 and idle.live_actors() == []
    short_started, long_started = threading.Event(), threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        short = pool.submit(stream_outcome, busy.base_url, "Count slowly:", 120, short_started)
        long = pool.submit(stream_outcome, busy.base_url, "Count for ever:", 3000, long_started)
        assert short_started.wait(60) and long_started.wait(60), "the streams did not start"
        busy.proc.send_signal(signal.SIGINT)  # drain: the short stream finishes
        text, finish, error = short.result(timeout=60)
        assert error is None and finish == "length" and text
        assert busy.proc.poll() is None, "the launcher stopped before the long stream ended"
        busy.proc.send_signal(signal.SIGINT)  # the second Ctrl-C: stop at once
        busy.proc.wait(timeout=5)
        _, _, error = long.result(timeout=10)
    assert error is not None and "shutting down" in error["message"], error
    assert busy.proc.returncode == 0 and busy.live_actors() == []
    assert "second signal: stopping every actor at once" in busy.log()
