"""The ring on a three-node NATS cluster (tests/nats_cluster.py: routes, JetStream, the same per-role users on
every node), each actor its own process with a `--nats-url` list of all three nodes. Under load (concurrent
greedy streams), the node the scheduler is connected to is killed (SIGKILL), and separately hung (SIGSTOP):
every stream completes whole (the text a stream gets with no fault) or ends with an explicit error event, never
hangs or ends short; a new request succeeds within seconds; the scheduler is on another node; no actor holds
state for any request afterwards (`live_rids` 0 in every heartbeat); no actor exited."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ringserve.actors.launcher.nats_auth import generate_auth
from ringserve.actors.launcher.ring import actor_specs
from ringserve.actors.launcher.serve_flags import serve_args
from ringserve.bus.embedded_server import die_with_parent, free_port
from tests.nats_cluster import NatsCluster
from tests.server_helpers import REPO, sse_events

NS = "tcluster"
HOME = {"entry": 0, "tokenizer": 1, "detokenizer": 1, "scheduler": 2}  # the node listed first for each role
ROLES = ("scheduler", "tokenizer", "detokenizer", "entry")
BODY = {"max_tokens": 300, "temperature": 0, "ignore_eos": True}
PROMPTS = [f"Story {i}: once upon a time" for i in range(4)]
# The detokenizer frees a request's state only on a row that finishes it or shows a gap. When the scheduler ends
# requests (finished, aborted) while its rows go into a hung node, no further row comes and the state stays:
# seen when the scheduler and the detokenizer shared the hung node. Set False once the detokenizer also drops
# the state of requests that end without its knowing (an abort subscription, or an idle timeout).
DETOKENIZER_LEAK_KNOWN = False


@dataclass
class ClusterRing:
    """Three NATS nodes and one actor process per role, spread over them."""

    cluster: NatsCluster
    procs: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, Path]
    base_url: str

    def log(self) -> str:
        return "\n".join(f"--- {name}\n{path.read_text(errors='replace')[-2500:]}" for name, path in self.logs.items())

    def info(self) -> dict[str, Any]:
        return httpx.get(self.base_url + "/get_server_info", timeout=10).json()

    def scheduler_node(self) -> int | None:
        return self.cluster.node_of("scheduler-0-")

    def placement(self) -> dict[str, int | None]:
        """Role -> the node its actor is connected to (nats-py shuffles each `--nats-url` list)."""
        return {role: self.cluster.node_of(f"{role}-0-") for role in ROLES}


def _spawn(module: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def ring(tiny_model_dir: Path) -> Iterator[ClusterRing]:
    workdir = Path(tempfile.mkdtemp(prefix="ringserve-cluster-test-"))
    auth = generate_auth(NS, workdir / "creds")
    cluster = NatsCluster.loopback(3, authorization=auth.authorization()).start()
    port = free_port()
    args = serve_args({"model": str(tiny_model_dir), "port": port, "namespace": NS, "max_total_tokens": 8192,
                       "grammar_warm_up": False})  # no warm compile workers (~200 MB each) for this ring
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}
    handle = ClusterRing(cluster, procs, logs, f"http://127.0.0.1:{port}")
    try:
        for spec in sorted(actor_specs(args, "tiny"), key=lambda s: s.stage):  # the entry opens its port last
            logs[spec.name] = workdir / f"{spec.name}.log"
            procs[spec.name] = _spawn(spec.module, ["--nats-url", cluster.url_list(HOME[spec.role]),
                                                    "--namespace", NS, *auth.actor_args(spec.role), *spec.args],
                                      logs[spec.name])
        _wait_ready(handle)
        yield handle
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        cluster.stop()


def _wait_ready(ring: ClusterRing, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [name for name, proc in ring.procs.items() if proc.poll() is not None]
        assert not dead, f"{dead} exited during startup:\n{ring.log()}"
        try:
            if httpx.get(ring.base_url + "/health", timeout=2).status_code == 200 and all(
                    f"{role}0" in ring.info()["actors"] for role in ROLES):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"the ring was not ready within {timeout}s:\n{ring.log()}")


def _complete(ring: ClusterRing, prompt: str, **extra: Any) -> str:
    response = httpx.post(ring.base_url + "/v1/completions", json={"prompt": prompt, **BODY, **extra}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _stream(ring: ClusterRing, prompt: str, started: threading.Event) -> tuple[str, str]:
    """("done", text) when the stream finished, ("error", message) when it ended with an error event, ("cut",
    text) when it ended without either."""
    text = ""
    body = {"prompt": prompt, **BODY, "stream": True}
    with httpx.stream("POST", ring.base_url + "/v1/completions", json=body, timeout=60) as response:
        for event in sse_events(response):
            if event == "[DONE]":
                return "done", text
            if "error" in event:
                return "error", str(event["error"])
            text += event["choices"][0]["text"]
            if text:
                started.set()
    return "cut", text


@pytest.fixture(scope="module")
def reference(ring: ClusterRing) -> dict[str, str]:
    """Each prompt's greedy text with no fault, streamed concurrently as under the fault."""
    events = [threading.Event() for _ in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        outcomes = list(pool.map(lambda pe: _stream(ring, *pe), zip(PROMPTS, events)))
    assert all(kind == "done" for kind, _ in outcomes), outcomes
    return {prompt: text for prompt, (_, text) in zip(PROMPTS, outcomes)}


def _under_load(ring: ClusterRing, reference: dict[str, str], fault: Any) -> tuple[list[tuple[str, str]], float]:
    """Start every prompt's stream, call `fault()` once each has text, check that a new request succeeds within
    seconds (while the streams run on), and collect the outcomes: every stream must complete whole or end with an
    error. Returns the outcomes and how many seconds after the fault the new request succeeded."""
    events = [threading.Event() for _ in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(_stream, ring, p, e) for p, e in zip(PROMPTS, events)]
        assert all(e.wait(60) for e in events), ring.log()
        fault()
        recovered = _serves_again(ring, time.monotonic())
        outcomes = [f.result(timeout=120) for f in futures]  # a hung stream fails here
    for prompt, (kind, text) in zip(PROMPTS, outcomes):
        assert kind in ("done", "error"), (prompt, kind, text)
        if kind == "done":
            assert text == reference[prompt], f"{prompt!r} completed but its text differs from the fault-free one"
    return outcomes, recovered


def _serves_again(ring: ClusterRing, since: float, within: float = 30.0) -> float:
    """Seconds from `since` until a new request succeeds (fails after `within` s)."""
    deadline = since + within
    last: object = None
    while time.monotonic() < deadline:
        try:
            response = httpx.post(ring.base_url + "/v1/completions",
                                  json={"prompt": "After the fault:", "max_tokens": 8, "temperature": 0}, timeout=5)
            if response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8:
                return time.monotonic() - since
            last = response.text
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise AssertionError(f"no request succeeded within {within}s of the fault: {last}\n{ring.log()}")


def _settled(ring: ClusterRing, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until every actor beats with live_rids 0 and the entry's admitted == terminal; returns the info.

    Generous: an abort the entry published into the hung node is lost, and the scheduler then frees that request
    only when it reaches max_tokens (on this shared CPU, tens of seconds)."""
    deadline = time.monotonic() + timeout
    info: dict[str, Any] = {}
    while time.monotonic() < deadline:
        info = ring.info()
        actors = info["actors"]
        if (all(f"{role}0" in actors for role in ROLES) and all(a["live_rids"] == 0 for a in actors.values())
                and info["entry_admitted_total"] == info["entry_terminal_total"]):
            return info
        time.sleep(0.3)
    actors = info.get("actors", {})
    if (DETOKENIZER_LEAK_KNOWN and [n for n, a in actors.items() if a["live_rids"]] == ["detokenizer0"]
            and info["entry_admitted_total"] == info["entry_terminal_total"]):
        pytest.xfail(f"known bug: the detokenizer keeps the state of requests whose last row was lost on the hung "
                     f"node (it frees a request only on a finishing or gapped row): {actors}")
    raise AssertionError(f"per-request state left behind: {actors}, admitted {info.get('entry_admitted_total')} "
                         f"terminal {info.get('entry_terminal_total')}\n{ring.log()}")


def _check_recovered(ring: ClusterRing, lost: int) -> None:
    _serves_again(ring, time.monotonic())
    moved = ring.scheduler_node()
    assert moved is not None and moved != lost, f"the scheduler is on node {moved}, not off node {lost}"
    _settled(ring)
    dead = {name: proc.returncode for name, proc in ring.procs.items() if proc.poll() is not None}
    assert not dead, f"actors exited: {dead}\n{ring.log()}"


def test_the_actors_spread_over_the_nodes_and_serve(ring: ClusterRing, reference: dict[str, str]) -> None:
    placement = ring.placement()
    assert all(node is not None for node in placement.values()), placement
    assert all(len(ring.cluster.peers(i)) == 2 for i in range(3))
    assert _complete(ring, PROMPTS[0]) == reference[PROMPTS[0]]  # alone, as in the concurrent batch
    _settled(ring)


def test_a_killed_node_loses_no_stream_silently(ring: ClusterRing, reference: dict[str, str]) -> None:
    node = ring.scheduler_node()
    assert node is not None
    print("placement", ring.placement(), "SIGKILL of node", node)
    try:
        outcomes, recovered = _under_load(ring, reference, lambda: ring.cluster.kill(node))
        _check_recovered(ring, node)
    finally:
        ring.cluster.restart(node)
    print(f"after SIGKILL of node {node}: served again in {recovered:.1f} s; outcomes", [k for k, _ in outcomes])


def test_a_hung_node_loses_no_stream_silently(ring: ClusterRing, reference: dict[str, str]) -> None:
    node = ring.scheduler_node()
    assert node is not None
    print("placement", ring.placement(), "SIGSTOP of node", node)
    try:
        outcomes, recovered = _under_load(ring, reference, lambda: ring.cluster.hang(node))
        _check_recovered(ring, node)
    finally:
        ring.cluster.restart(node)  # SIGCONT, then a fresh start on its ports
    _serves_again(ring, time.monotonic())
    _settled(ring)
    print(f"after SIGSTOP of node {node}: served again in {recovered:.1f} s; outcomes", [k for k, _ in outcomes])
