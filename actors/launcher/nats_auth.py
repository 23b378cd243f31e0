"""NATS credentials of one deployment, as the launcher hands them to its actors.

With the embedded nats-server, `generate_auth` makes one user per role (random password; clients on request)
with the allow lists of bus/permissions.py, writes each role's JSON credentials (0600) into a private 0700
directory, and gives the server the matching `authorization` block. Each actor gets only the *path* of its
file on its command line (`--nats-creds`), so no secret appears in `ps` or in a log.

With an external NATS (`--nats-url`), `external_actor_args` forwards what the operator gave: one credentials
file for every role, a directory of per-role files (as `ringserve nats-config` writes them), or a user name
(password in $RINGSERVE_NATS_PASSWORD, inherited through the environment), plus TLS options.

For a NATS cluster, `write_cluster_configs` writes one complete server config per node (`<node>.conf`), each
with the same per-role `authorization` block, JetStream on, and routes that authenticate with one generated
route user.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence
from urllib.parse import unquote, urlsplit, urlunsplit

from ringserve.actors.common.actor_flags import NatsAuthFlags
from ringserve.actors.common.flag_fields import to_argv
from ringserve.bus.credentials import NatsCredentials, credentials_from_options, load_credentials_file, write_credentials_file
from ringserve.bus.embedded_server import MAX_PAYLOAD_BYTES, cluster_node_config, free_port
from ringserve.bus.image_store import DEFAULT_MAX_BYTES, DEFAULT_TTL_SECONDS, client_bucket_name
from ringserve.bus.permissions import (
    CLIENT_ROLE, ROLES, NatsUser, authorization_block, client_permissions, inbox_prefix, role_permissions,
)
from ringserve.bus.subjects import Subjects, validate_rid

AUTH_CONFIG_NAME = "nats-auth.conf"


@dataclass
class DeploymentAuth:
    """Generated users of one namespace and where their credentials files are."""

    directory: Path
    users: list[NatsUser] = field(default_factory=list)
    role_files: dict[str, Path] = field(default_factory=dict)
    client_files: dict[str, Path] = field(default_factory=dict)

    def authorization(self) -> str:
        """The nats-server `authorization` block for these users."""
        return authorization_block(self.users)

    def credentials(self, role: str) -> NatsCredentials:
        """The credentials of internal role `role`."""
        return load_credentials_file(self.role_files[role])

    def actor_args(self, role: str) -> list[str]:
        """What an actor of `role` gets on its command line: the path of its credentials file."""
        return ["--nats-creds", str(self.role_files[role])]


def private_directory(prefix: str = "ringserve-auth-") -> Path:
    """A fresh directory only this user can enter (mkdtemp makes it 0700)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def generate_auth(namespace: str, directory: Path, clients: Sequence[str] = (), url: str | None = None,
                  image_ttl: float = DEFAULT_TTL_SECONDS, image_max_bytes: int = DEFAULT_MAX_BYTES) -> DeploymentAuth:
    """One user per role of `namespace` (and per named client), with random passwords, written to `directory`.

    Files: `<role>.json` per role, `client-<name>.json` per client (with notes on its subjects, inbox prefix and
    image bucket, and the limits it creates that bucket with: `image_ttl`, `image_max_bytes`, the shared bucket's),
    and `nats-auth.conf`, the server's authorization block.
    """
    subjects = Subjects(namespace)
    for i, name in enumerate(clients):
        validate_rid(name)
        if name in clients[:i]:
            raise ValueError(f"client {name!r} named twice")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    auth = DeploymentAuth(directory)
    for role in ROLES:
        user = NatsUser(f"{namespace}-{role}", secrets.token_urlsafe(24), role_permissions(namespace, role, clients))
        auth.users.append(user)
        auth.role_files[role] = write_credentials_file(directory / f"{role}.json", user.user, user.password)
    for name in clients:
        user = NatsUser(f"{namespace}-client-{name}", secrets.token_urlsafe(24), client_permissions(namespace, name))
        auth.users.append(user)
        notes = {"client": name, "namespace": namespace, "inbox_prefix": inbox_prefix(namespace, CLIENT_ROLE, name),
                 **subjects.client_subject_templates(name), "image_bucket": client_bucket_name(namespace, name),
                 "image_ttl": image_ttl, "image_store_max_bytes": image_max_bytes, **({"url": url} if url else {})}
        auth.client_files[name] = write_credentials_file(directory / f"client-{name}.json", user.user, user.password,
                                                         **notes)
    fd = os.open(directory / AUTH_CONFIG_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(auth.authorization())
    return auth


ROUTE_USER = "route"  # the one user nodes of a cluster authenticate their routes with


@dataclass(frozen=True)
class ClusterNode:
    """One node of a NATS cluster: its server name and the `host:port` other nodes reach its routes on."""

    name: str
    route: str


def parse_cluster_nodes(spec: str) -> list[ClusterNode]:
    """`NAME=HOST:PORT,...` (a bare `HOST:PORT` is named `nats-<i>`) -> the cluster's nodes, in order (ValueError
    for fewer than 3, a name twice, or an address without a port)."""
    nodes = []
    for i, item in enumerate(part.strip() for part in spec.split(",") if part.strip()):
        name, _, route = item.rpartition("=")
        name = name or f"nats-{i}"
        host, _, port = route.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"cluster node {item!r}: give NAME=HOST:PORT (the node's cluster address)")
        if not all(c.isalnum() or c in "-_." for c in name) or f"{name}.conf" == AUTH_CONFIG_NAME:
            raise ValueError(f"cluster node name {name!r}: letters, digits, '-', '_' and '.' only, and not "
                             f"{AUTH_CONFIG_NAME.removesuffix('.conf')!r}")
        nodes.append(ClusterNode(name, route))
    if len(nodes) < 3:
        raise ValueError(f"a NATS cluster with JetStream needs at least 3 nodes, got {len(nodes)}")
    if len({n.name for n in nodes}) != len(nodes):
        raise ValueError("a cluster node name appears twice")
    return nodes


def write_cluster_configs(auth: DeploymentAuth, nodes: list[ClusterNode], cluster_name: str, listen: str,
                          cluster_listen: str, http_port: int, store_dir: str) -> dict[str, Path]:
    """Write `<node>.conf` (0600) for every node into `auth.directory`: client `listen`, monitoring on
    `http_port`, max_payload, JetStream in `store_dir`, the cluster block with routes to every other node,
    and `auth`'s authorization block (the same on each node). Returns node name -> path."""
    route_password = secrets.token_urlsafe(24)
    written: dict[str, Path] = {}
    for node in nodes:
        header = (f"# NATS node {node.name} of cluster {cluster_name} for ringserve (written by ringserve nats-config;"
                  f" it holds passwords: keep it private)\nlisten: {json.dumps(listen)}\nhttp_port: {http_port}\n"
                  f"max_payload: {MAX_PAYLOAD_BYTES}\n")
        body = cluster_node_config(node.name, cluster_name, cluster_listen,
                                   [other.route for other in nodes if other != node], store_dir,
                                   ROUTE_USER, route_password)
        path = auth.directory / f"{node.name}.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(header + body + auth.authorization())
        written[node.name] = path
    return written


def split_url_credentials(url: str) -> tuple[str, NatsCredentials | None]:
    """`nats://user:pass@host:port` -> (`nats://host:port`, its credentials); a URL without them is unchanged."""
    parts = urlsplit(url)
    if parts.username is None:
        return url, None
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    clean = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return clean, NatsCredentials(user=unquote(parts.username), password=unquote(parts.password or ""))


def external_actor_args(args: argparse.Namespace, role: str) -> list[str]:
    """The NATS auth options an actor of `role` gets on an external NATS (paths and names only, no secrets)."""
    creds = str(role_creds_path(Path(args.nats_creds_dir), role)) if args.nats_creds_dir else args.nats_creds
    return to_argv(NatsAuthFlags(nats_creds=creds or None, nats_user=None if creds else args.nats_user or None,
                                 nats_tls_ca=args.nats_tls_ca or None, nats_tls_cert=args.nats_tls_cert or None,
                                 nats_tls_key=args.nats_tls_key or None))


def role_creds_path(directory: Path, role: str) -> Path:
    """`<dir>/<role>.creds` if present (a NATS creds file), else `<dir>/<role>.json`."""
    creds = directory / f"{role}.creds"
    return creds if creds.is_file() else directory / f"{role}.json"


@dataclass
class NatsPlan:
    """How one `ringserve serve` reaches NATS: the URL, the embedded server's auth, everyone's credentials."""

    url: str  # never holds credentials: it goes on actors' command lines and into logs
    external: bool
    port: int | None = None  # the embedded server's port
    authorization: str = ""  # the embedded server's authorization block
    launcher_credentials: NatsCredentials | None = None
    generated: DeploymentAuth | None = None
    external_args: argparse.Namespace | None = None
    private_dirs: list[Path] = field(default_factory=list)

    def role_args(self, role: str) -> list[str]:
        """The auth options an actor of `role` is started with."""
        if self.generated is not None:
            return self.generated.actor_args(role)
        assert self.external_args is not None
        return external_actor_args(self.external_args, role)

    def cleanup(self) -> None:
        """Delete the private credential directories this plan made."""
        for directory in self.private_dirs:
            shutil.rmtree(directory, ignore_errors=True)


def plan_nats(args: argparse.Namespace, namespace: str) -> NatsPlan:
    """Decide URL and credentials from the serve flags (raises ValueError or CredentialsError when they clash).

    No `--nats-url`: an embedded server on a free loopback port with generated per-role users. With one: the
    given credentials (a user:password in the URL is moved into a private file, off every command line).
    """
    auth_flags = [flag for flag, value in (("--nats-creds", args.nats_creds), ("--nats-creds-dir", args.nats_creds_dir),
                                           ("--nats-user", args.nats_user), ("--nats-tls-ca", args.nats_tls_ca),
                                           ("--nats-tls-cert", args.nats_tls_cert),
                                           ("--nats-tls-key", args.nats_tls_key)) if value]
    if not args.nats_url:
        if auth_flags:
            raise ValueError(f"{', '.join(auth_flags)} need --nats-url (the embedded server makes its own users)")
        port = free_port()
        url = f"nats://127.0.0.1:{port}"
        directory = private_directory()
        try:
            auth = generate_auth(namespace, directory, list(args.nats_client or []), url, args.image_ttl,
                                 args.image_store_max_bytes)
        except ValueError:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return NatsPlan(url=url, external=False, port=port, authorization=auth.authorization(),
                        launcher_credentials=auth.credentials("launcher"), generated=auth, private_dirs=[directory])
    if args.nats_client:
        raise ValueError("--nats-client needs the embedded server; for an external NATS use `ringserve nats-config`")
    if sum(bool(v) for v in (args.nats_creds, args.nats_creds_dir, args.nats_user)) > 1:
        raise ValueError("give one of --nats-creds, --nats-creds-dir, --nats-user")
    url, in_url = split_url_credentials(args.nats_url)
    forwarded = argparse.Namespace(**vars(args))
    plan = NatsPlan(url=url, external=True, external_args=forwarded)
    if in_url is not None:
        if args.nats_creds or args.nats_creds_dir or args.nats_user:
            raise ValueError("credentials in --nats-url and in another flag: give them once")
        directory = private_directory()
        plan.private_dirs.append(directory)
        forwarded.nats_creds = str(write_credentials_file(directory / "nats.json", in_url.user or "",
                                                          in_url.password or ""))
    creds = str(role_creds_path(Path(args.nats_creds_dir), "launcher")) if args.nats_creds_dir else forwarded.nats_creds
    try:
        plan.launcher_credentials = credentials_from_options(creds, None if creds else args.nats_user,
                                                             args.nats_tls_ca, args.nats_tls_cert, args.nats_tls_key)
    except ValueError:  # CredentialsError too
        plan.cleanup()
        raise
    return plan
