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
from pathlib import Path

from ringserve.actors.launcher.nats_auth import AUTH_CONFIG_NAME, generate_auth, parse_cluster_nodes, write_cluster_configs
from ringserve.bus.subjects import Subjects


# the per-node settings of --cluster-nodes: flag, default, metavar, help
CLUSTER_OPTIONS = (
    ("--cluster-name", "ringserve", "NAME", "the cluster's name (the same on every node)"),
    ("--listen", "0.0.0.0:4222", "HOST:PORT", "where each node takes client connections"),
    ("--cluster-listen", "0.0.0.0:6222", "HOST:PORT", "where each node takes routes from the other nodes"),
    ("--http-port", 8222, "PORT", "each node's monitoring port (/healthz, /routez: the probes)"),
    ("--store-dir", "/data", "DIR", "each node's JetStream store directory"),
)


def add_nats_config_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register the `nats-config` subcommand."""
    cmd = commands.add_parser("nats-config", help="write per-role NATS users and credentials for an external NATS",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cmd.add_argument("--out", required=True, metavar="DIR", help="new directory for the config and credentials")
    cmd.add_argument("--namespace", default="ringserve", help="the deployment's subject prefix")
    cmd.add_argument("--client", action="append", default=[], metavar="NAME",
                     help="also make a user for outside NATS client NAME (repeatable)")
    cmd.add_argument("--nats-url", default=None, help="noted in the clients' credentials files")
    cluster = cmd.add_argument_group("NATS cluster", "with --cluster-nodes, also write one server config per node")
    cluster.add_argument("--cluster-nodes", default=None, metavar="NAME=HOST:PORT,...",
                         help="every node of the cluster (at least 3): its server name and the address the other "
                              "nodes reach its cluster port on, e.g. nats-0=10.0.0.1:6222,nats-1=10.0.0.2:6222,"
                              "nats-2=10.0.0.3:6222 (a bare HOST:PORT is named nats-<i>); writes <name>.conf each")
    for flag, default, metavar, what in CLUSTER_OPTIONS:
        cluster.add_argument(flag, default=argparse.SUPPRESS, metavar=metavar,  # absent unless given
                             type=int if flag == "--http-port" else str,
                             help=f"{what} (default: {default})")

def nats_config(args: argparse.Namespace) -> int:
    """Write the files; the exit code (2 when the directory already exists or a name is invalid)."""
    out = Path(args.out)
    if out.exists():
        print(f"ringserve: {out} already exists; give a new directory", file=sys.stderr)
        return 2
    given = [flag for flag, *_ in CLUSTER_OPTIONS if hasattr(args, _dest(flag))]
    if given and args.cluster_nodes is None:
        print(f"ringserve: {', '.join(given)} describe cluster nodes: give --cluster-nodes too", file=sys.stderr)
        return 2
    for flag, default, *_ in CLUSTER_OPTIONS:
        if not hasattr(args, _dest(flag)):
            setattr(args, _dest(flag), default)
    try:
        Subjects(args.namespace)
        nodes = parse_cluster_nodes(args.cluster_nodes) if args.cluster_nodes is not None else []
        auth = generate_auth(args.namespace, out, args.client, args.nats_url)
    except ValueError as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    configs = write_cluster_configs(auth, nodes, args.cluster_name, args.listen, args.cluster_listen,
                                    args.http_port, args.store_dir) if nodes else {}
    print(f"wrote {out / AUTH_CONFIG_NAME} and credentials for {', '.join(sorted(auth.role_files))}"
          + "".join(f", client {name}" for name in auth.client_files)
          + "".join(f"\nwrote {path}: on node {name} run nats-server -c {path.name}" for name, path in configs.items())
          + f"\nrun: ringserve serve --nats-url URL --namespace {args.namespace} --nats-creds-dir {out}"
          + ("\n  or one actor per host: ringserve worker --role ROLE --nats-url URL,URL,... "
             f"--namespace {args.namespace} --nats-creds {out}/ROLE.json" if nodes else ""))
    return 0


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")
