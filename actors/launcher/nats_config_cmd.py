"""`ringserve nats-config`: per-role NATS users for running ringserve on a NATS server you operate.

Writes into a new private directory `nats-auth.conf` (an `authorization { users = [...] }` block with each
role's least-privilege allow lists, from bus/permissions.py), `<role>.json` per role and `client-<name>.json`
per `--client`. Put the block into the server's config (copy it beside the config and `include nats-auth.conf`:
include paths are relative; a server has one `authorization` block, so merge it by hand with users you already
have), then start
`ringserve serve --nats-url URL --nats-creds-dir DIR` and give each outside client its own file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from actors.launcher.nats_auth import AUTH_CONFIG_NAME, generate_auth
from bus.subjects import Subjects


def add_nats_config_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register the `nats-config` subcommand."""
    cmd = commands.add_parser("nats-config", help="write per-role NATS users and credentials for an external NATS",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cmd.add_argument("--out", required=True, metavar="DIR", help="new directory for the config and credentials")
    cmd.add_argument("--namespace", default="ringserve", help="the deployment's subject prefix")
    cmd.add_argument("--client", action="append", default=[], metavar="NAME",
                     help="also make a user for outside NATS client NAME (repeatable)")
    cmd.add_argument("--nats-url", default=None, help="noted in the clients' credentials files")


def nats_config(args: argparse.Namespace) -> int:
    """Write the files; the exit code (2 when the directory already exists or a name is invalid)."""
    out = Path(args.out)
    if out.exists():
        print(f"ringserve: {out} already exists; give a new directory", file=sys.stderr)
        return 2
    try:
        Subjects(args.namespace)
        auth = generate_auth(args.namespace, out, args.client, args.nats_url)
    except ValueError as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out / AUTH_CONFIG_NAME} and credentials for {', '.join(sorted(auth.role_files))}"
          + "".join(f", client {name}" for name in auth.client_files)
          + f"\nrun: ringserve serve --nats-url URL --namespace {args.namespace} --nats-creds-dir {out}")
    return 0
