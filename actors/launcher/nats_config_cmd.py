"""`ringserve nats-config`: per-role NATS users for running ringserve on a NATS server you operate.

Writes into a new private directory `nats-auth.conf` (an `authorization { users = [...] }` block with each
role's least-privilege allow lists, from bus/permissions.py), `<role>.json` per role and `client-<name>.json`
per `--client` (noting its subjects, inbox prefix and image bucket; the tokenizer's user may read each client's image
bucket, so adding a client means writing the users again). Put the block into the server's config (copy it beside the config and `include nats-auth.conf`:
include paths are relative; a server has one `authorization` block, so merge it by hand with users you already
have), then start
`ringserve serve --nats-url URL --nats-creds-dir DIR` and give each outside client its own file.

With `--cluster-nodes` it also writes a complete config per node of a NATS cluster (`<node>.conf`: JetStream on,
the cluster block with authenticated routes to every other node, and the same per-role users on each node):
run `nats-server -c <node>.conf` on each node's host (docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringserve.actors.common import flag_fields
from ringserve.actors.common.flag_fields import flag
from ringserve.actors.common.help_format import DefaultOnceFormatter
from ringserve.actors.launcher.nats_auth import AUTH_CONFIG_NAME, generate_auth, parse_cluster_nodes, write_cluster_configs
from ringserve.bus.subjects import Subjects

CLUSTER = "NATS cluster"
CLUSTER_DESCRIPTION = "with --cluster-nodes, also write one server config per node"
# the per-node settings of --cluster-nodes when not given (their flags default to None: "not given")
CLUSTER_DEFAULTS: dict[str, Any] = {"cluster_name": "ringserve", "listen": "0.0.0.0:4222",
                                    "cluster_listen": "0.0.0.0:6222", "http_port": 8222, "store_dir": "/data"}


def _per_node(name: str, what: str, metavar: str, kind: type = str) -> Any:
    """A per-node setting's field: None unless given (then it needs --cluster-nodes), else CLUSTER_DEFAULTS'."""
    return field(default=None, metadata=flag(f"{what} (default: {CLUSTER_DEFAULTS[name]})", group=CLUSTER,
                                             metavar=metavar, type=kind))


@dataclass
class NatsConfigFlags:
    """The flags of `ringserve nats-config`."""

    out: str = field(default="", metadata=flag(
        "new directory for the config and credentials", required=True, metavar="DIR"))
    namespace: str = field(default="ringserve", metadata=flag("the deployment's subject prefix"))
    client: list[str] = field(default_factory=list, metadata=flag(
        "also make a user for outside NATS client NAME (repeatable)", action="append", metavar="NAME"))
    nats_url: str | None = field(default=None, metadata=flag("noted in the clients' credentials files"))
    cluster_nodes: str | None = field(default=None, metadata=flag(
        "every node of the cluster (at least 3): its server name and the address the other nodes reach its "
        "cluster port on, e.g. nats-0=10.0.0.1:6222,nats-1=10.0.0.2:6222,nats-2=10.0.0.3:6222 (a bare HOST:PORT "
        "is named nats-<i>); writes <name>.conf each", group=CLUSTER, metavar="NAME=HOST:PORT,..."))
    cluster_name: str | None = _per_node("cluster_name", "the cluster's name (the same on every node)", "NAME")
    listen: str | None = _per_node("listen", "where each node takes client connections", "HOST:PORT")
    cluster_listen: str | None = _per_node("cluster_listen", "where each node takes routes from the other nodes",
                                           "HOST:PORT")
    http_port: int | None = _per_node("http_port", "each node's monitoring port (/healthz, /routez: the probes)",
                                      "PORT", int)
    store_dir: str | None = _per_node("store_dir", "each node's JetStream store directory", "DIR")

    def given_node_settings(self) -> list[str]:
        """The flags of the per-node settings given."""
        return [f"--{name.replace('_', '-')}" for name in CLUSTER_DEFAULTS if getattr(self, name) is not None]

    def node_setting(self, name: str) -> Any:
        """Per-node setting `name`: as given, else its default."""
        value = getattr(self, name)
        return CLUSTER_DEFAULTS[name] if value is None else value


def add_nats_config_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register the `nats-config` subcommand."""
    cmd = commands.add_parser("nats-config", help="write per-role NATS users and credentials for an external NATS",
                              formatter_class=DefaultOnceFormatter)
    cmd.add_argument_group(CLUSTER, CLUSTER_DESCRIPTION)  # its fields' group, with its description
    flag_fields.add_arguments(NatsConfigFlags, cmd)


def nats_config(args: argparse.Namespace) -> int:
    """Write the files; the exit code (2 when the directory already exists or a name is invalid)."""
    flags = flag_fields.from_args(NatsConfigFlags, args)
    out = Path(flags.out)
    if out.exists():
        print(f"ringserve: {out} already exists; give a new directory", file=sys.stderr)
        return 2
    given = flags.given_node_settings()
    if given and flags.cluster_nodes is None:
        print(f"ringserve: {', '.join(given)} describe cluster nodes: give --cluster-nodes too", file=sys.stderr)
        return 2
    try:
        Subjects(flags.namespace)
        nodes = parse_cluster_nodes(flags.cluster_nodes) if flags.cluster_nodes is not None else []
        auth = generate_auth(flags.namespace, out, flags.client, flags.nats_url)
    except ValueError as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    settings = {name: flags.node_setting(name) for name in CLUSTER_DEFAULTS}
    configs = write_cluster_configs(auth, nodes, **settings) if nodes else {}
    print(f"wrote {out / AUTH_CONFIG_NAME} and credentials for {', '.join(sorted(auth.role_files))}"
          + "".join(f", client {name}" for name in auth.client_files)
          + "".join(f"\nwrote {path}: on node {name} run nats-server -c {path.name}" for name, path in configs.items())
          + f"\nrun: ringserve serve --nats-url URL --namespace {flags.namespace} --nats-creds-dir {out}"
          + ("\n  or one actor per host: ringserve worker --role ROLE --nats-url URL,URL,... "
             f"--namespace {flags.namespace} --nats-creds {out}/ROLE.json" if nodes else ""))
    return 0
