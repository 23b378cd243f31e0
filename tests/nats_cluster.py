"""An N-node nats-server cluster on loopback for tests: free ports, authenticated routes between every pair of
nodes, JetStream on (temporary store directories), the same client `authorization` block on each node.

Each node is an `EmbeddedNatsServer` whose extra config comes from `cluster_node_config`, the renderer
`ringserve nats-config --cluster-nodes` writes production nodes with (`loopback`), or from the node configs that
command wrote, moved onto loopback ports (`from_configs`). `start` returns once every node has a
route to every other (the monitoring endpoint `/routez`). Nodes can be killed (SIGKILL), hung (SIGSTOP),
resumed and restarted on their old ports; `connections(i)` names the clients connected to node i (`/connz`).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import tempfile
import time
from pathlib import Path

import httpx

from ringserve.bus.embedded_server import EmbeddedNatsServer, cluster_node_config, free_port


class NatsCluster:
    """nats-server nodes on 127.0.0.1 with routes to each other; a context manager. Make one with `loopback`
    or `from_configs`."""

    def __init__(self, nodes: dict[str, tuple[int, int, str]], store: tempfile.TemporaryDirectory[str]) -> None:
        """`nodes`: server name -> (client port, monitoring port, the rest of its config), in node order."""
        self._store = store
        self.names = list(nodes)
        self.size = len(nodes)
        self.http_ports = [http for _, http, _ in nodes.values()]
        self.nodes = [EmbeddedNatsServer(port=port, extra_config=f"http_port: {http}\n{config}",
                                         log_file=str(Path(store.name) / f"{name}.log"))
                      for name, (port, http, config) in nodes.items()]

    @classmethod
    def loopback(cls, size: int = 3, authorization: str = "", name: str = "ringserve-test") -> "NatsCluster":
        """`size` nodes `node0`... with authenticated routes; `authorization`: a top-level `authorization {...}`
        block (bus/permissions.py) put on every node."""
        store = tempfile.TemporaryDirectory(prefix="ringserve-cluster-")
        routes = [free_port() for _ in range(size)]
        password = secrets.token_urlsafe(16)
        nodes = {}
        for i in range(size):
            (Path(store.name) / f"node{i}").mkdir()
            others = [f"127.0.0.1:{port}" for j, port in enumerate(routes) if j != i]
            config = cluster_node_config(f"node{i}", name, f"127.0.0.1:{routes[i]}", others,
                                         str(Path(store.name) / f"node{i}"), "route", password, max_file_store="256MiB")
            nodes[f"node{i}"] = (free_port(), free_port(), config + authorization)
        return cls(nodes, store)

    @classmethod
    def from_configs(cls, configs: dict[str, str], routes: dict[str, str]) -> "NatsCluster":
        """The node configs `ringserve nats-config --cluster-nodes` wrote (name -> text), moved onto free loopback
        ports and temporary stores: their client `listen`, `http_port`, cluster `listen`, `store_dir`, and each
        route address (`routes`: name -> the host:port it was written with) become local ones."""
        store = tempfile.TemporaryDirectory(prefix="ringserve-cluster-")
        local = {name: f"127.0.0.1:{free_port()}" for name in configs}
        nodes = {}
        for name, config in configs.items():
            (Path(store.name) / name).mkdir()
            config = re.sub(r'^(listen|max_payload|http_port):.*$', "", config, flags=re.M)  # the server sets them
            config = re.sub(r'(cluster \{\s*name: "[^"]*"\s*listen: )"[^"]*"', rf'\g<1>"{local[name]}"', config)
            config = re.sub(r'store_dir: "[^"]*"', f'store_dir: "{Path(store.name) / name}"', config)
            for other, address in routes.items():
                config = config.replace(f"@{address}\"", f"@{local[other]}\"")
            nodes[name] = (free_port(), free_port(), config)
        return cls(nodes, store)

    @property
    def urls(self) -> list[str]:
        """Every node's client URL, in node order."""
        return [node.url for node in self.nodes]

    def url_list(self, first: int) -> str:
        """A `--nats-url` value: every node, node `first` first (nats-py shuffles the list unless told not to)."""
        order = [first, *(i for i in range(self.size) if i != first)]
        return ",".join(self.urls[i] for i in order)

    def log(self, i: int) -> str:
        """Node i's log."""
        path = Path(self._store.name) / f"{self.names[i]}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, timeout: float = 30.0) -> "NatsCluster":
        """Start every node and wait until each routes to all the others."""
        for node in self.nodes:
            node.start()
        self.wait_routed(range(self.size), timeout)
        return self

    def wait_routed(self, nodes: range | list[int], timeout: float = 30.0) -> None:
        """Wait until each of `nodes` has a route to every other live node; raises TimeoutError with the logs."""
        deadline = time.monotonic() + timeout
        for i in nodes:
            want = {self.names[j] for j in range(self.size) if j != i and self.is_up(j)}
            while self.peers(i) < want:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.names[i]} routes to {sorted(self.peers(i))}, not {sorted(want)}:\n"
                                       f"{self.log(i)[-3000:]}")
                time.sleep(0.1)

    def peers(self, i: int) -> set[str]:
        """Server names node i has a route to (empty while it does not answer)."""
        try:
            routez = httpx.get(f"http://127.0.0.1:{self.http_ports[i]}/routez", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return set()
        return {route.get("remote_name", "") for route in routez.get("routes") or []} - {""}

    def jetstream_ready(self, i: int) -> bool:
        """Whether node i's JetStream is up (`/healthz?js-enabled-only=true`, what the probes ask)."""
        try:
            return httpx.get(f"http://127.0.0.1:{self.http_ports[i]}/healthz?js-enabled-only=true",
                             timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def connections(self, i: int) -> list[str]:
        """The names of the clients connected to node i."""
        connz = httpx.get(f"http://127.0.0.1:{self.http_ports[i]}/connz?limit=1000", timeout=2).json()
        return [conn.get("name", "") for conn in connz.get("connections") or []]

    def node_of(self, client_prefix: str) -> int | None:
        """The live node a client whose name starts with `client_prefix` is connected to (None: none)."""
        for i in range(self.size):
            if self.is_up(i) and not self._stopped(i) and any(
                    name.startswith(client_prefix) for name in self.connections(i)):
                return i
        return None

    def is_up(self, i: int) -> bool:
        proc = self.nodes[i].process
        return proc is not None and proc.poll() is None

    def kill(self, i: int) -> None:
        """SIGKILL node i (no goodbye to its clients or routes)."""
        proc = self.nodes[i].process
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def hang(self, i: int) -> None:
        """SIGSTOP node i: its sockets stay open, it answers nothing."""
        proc = self.nodes[i].process
        assert proc is not None
        os.kill(proc.pid, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        proc = self.nodes[i].process
        assert proc is not None
        os.kill(proc.pid, signal.SIGCONT)

    def _stopped(self, i: int) -> bool:
        proc = self.nodes[i].process
        try:
            with open(f"/proc/{proc.pid}/stat") as stat:  # type: ignore[union-attr]
                return stat.read().rsplit(")", 1)[1].split()[0] == "T"
        except OSError:
            return False

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start node i again on its old ports (after `kill`) and wait until it is routed to the others."""
        if self.is_up(i):
            self.resume(i)
            self.kill(i)
        self.nodes[i].stop()
        self.nodes[i].start()
        self.wait_routed([i], timeout)

    def stop(self) -> None:
        for i, node in enumerate(self.nodes):
            if self.is_up(i):
                self.resume(i)  # a stopped process cannot act on SIGTERM
            node.stop()
        self._store.cleanup()

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
