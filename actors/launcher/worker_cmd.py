"""`ringserve worker`: run ONE actor of a deployment against an existing NATS, on any host.

    ringserve worker --role scheduler --nats-url nats://10.0.0.5:4222 --namespace prod

The actor runs in this process, with exactly the flags `python -m ringserve.actors.<role>` takes (each role's
`build_parser`; `ringserve worker --role R --help` lists them): the bus flags every role has (`--nats-url`, a
comma-separated list of a cluster's nodes; `--namespace`; `--nats-creds FILE`, the role's own credentials file
as `ringserve nats-config` writes it; `--drain-timeout`), the engine and admission flags for a scheduler, the
HTTP flags for an entry. There is no embedded NATS and no supervisor: a process manager (systemd, Kubernetes)
restarts a worker. SIGTERM/SIGINT drains it (actors/common/runtime.py): it takes nothing new, finishes what it
holds and exits 0; a second signal stops it at once.

What the worker adds: `--model` defaults to the packaged model for the roles that load it, and an entry takes
`--model` to name the model as `ringserve serve` does (unless `--served-model-name` is given). A scheduler joins
as a new replica: before its model loads it claims its replica id on the bus (bus/replica_claim.py), the lowest
free one unless `--dp-replica-id` names one, and exits 2 when a live replica holds that id.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from dataclasses import dataclass, field
from types import ModuleType

from ringserve.actors.common import flag_fields
from ringserve.actors.common.flag_fields import flag
from ringserve.actors.common.help_format import DefaultOnceFormatter
from ringserve.actors.common.model_source import DEFAULT_MODEL, resolve_model
from ringserve.bus.subjects import Subjects

ROLES = ("entry", "tokenizer", "scheduler", "detokenizer")
MODEL_ROLES = ("tokenizer", "scheduler", "detokenizer")  # the roles whose own flags include --model
SUMMARY = "run ONE actor (entry, tokenizer, scheduler or detokenizer) against an existing NATS, on any host"


@dataclass
class WorkerFlags:
    """The worker's own flags, read before the role's parser (which takes every other flag) is known."""

    role: str | None = field(default=None, metadata=flag(
        "the actor to run; `--role R --help` lists its flags", choices=ROLES))
    help: bool = field(default=False, metadata=flag("the overview, or with --role the role's flags",
                                                    aliases=("-h",)))


@dataclass
class EntryModelFlags:
    """What an entry worker reads of `--model` and `--served-model-name` before the entry's own parser (which
    takes only `--served-model-name`)."""

    model: str = field(default=DEFAULT_MODEL, metadata=flag("the model the entry names (its served name)"))
    served_model_name: str | None = field(default=None, metadata=flag("the name itself (then --model is unread)"))


def add_worker_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """List `worker` among the subcommands; its flags are parsed by `worker_command` (they depend on --role)."""
    worker = commands.add_parser("worker", help=SUMMARY, add_help=False, formatter_class=DefaultOnceFormatter)
    flag_fields.add_arguments(WorkerFlags, worker, names=("role",))


def _module(role: str) -> ModuleType:
    """The role's `python -m` module (its `build_parser` and `main(argv)`)."""
    return importlib.import_module(f"ringserve.actors.{role}.__main__")


def role_argv(role: str, argv: list[str]) -> list[str]:
    """The role's own argv from the worker's: the default `--model` where the role loads one (a later
    `--model` wins); for an entry, `--model` becomes `--served-model-name` (the model's name, as `ringserve
    serve` derives it) unless that is given. Raises ValueError for a model an entry cannot name."""
    if role in MODEL_ROLES:
        return ["--model", DEFAULT_MODEL, *argv]
    if role != "entry":
        return argv
    picker = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    flag_fields.add_arguments(EntryModelFlags, picker)
    parsed, rest = picker.parse_known_args(argv)
    known = flag_fields.from_args(EntryModelFlags, parsed)
    if known.served_model_name is not None:
        return [*rest, "--served-model-name", known.served_model_name]
    try:
        name = resolve_model(known.model).name
    except FileNotFoundError as exc:
        raise ValueError(f"{exc}; an entry names its model from --model, or give --served-model-name") from exc
    return [*rest, "--served-model-name", name]


def _parser(role: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = _module(role).build_parser(prog=f"ringserve worker --role {role}")
    parser.description = f"{SUMMARY}: the {role}, with the flags of `python -m ringserve.actors.{role}`."
    extra = {"entry": "--model names the model for /v1/models (default: the packaged model) unless "
                      "--served-model-name is given.",
             "scheduler": "Without --dp-replica-id it claims the lowest free replica id; an id a live replica holds "
                          "is refused (exit 2, before the model loads). The engine flags should match the other "
                          "replicas'."}
    parser.epilog = ("--model defaults to the packaged model. " if role in MODEL_ROLES else "") + extra.get(role, "")
    return parser


def _overview() -> str:
    lines = [f"usage: ringserve worker --role {{{','.join(ROLES)}}} --nats-url URL[,URL...] --namespace NS "
             "[--nats-creds FILE] [ROLE FLAGS]", "", SUMMARY + ".", "",
             "A scheduler worker joins as a new replica (the lowest free id, or --dp-replica-id), a second entry "
             "serves the same namespace (--host/--port). SIGTERM/SIGINT drains the worker: it takes nothing new, finishes what it holds "
             "(at most --drain-timeout seconds) and exits 0; a second signal stops it at once.", "",
             "`ringserve worker --role ROLE --help` lists a role's flags."]
    return "\n".join(textwrap.fill(line, 100, subsequent_indent="  " if line.startswith("usage") else "")
                     for line in lines)


def worker_command(argv: list[str]) -> int:
    """`ringserve worker ARGV`: check the flags and run the role's actor here (exits with its code)."""
    picker = argparse.ArgumentParser(prog="ringserve worker", add_help=False)
    flag_fields.add_arguments(WorkerFlags, picker)
    parsed, rest = picker.parse_known_args(argv)
    known = flag_fields.from_args(WorkerFlags, parsed)
    if known.role is None:
        if known.help:
            print(_overview())
            return 0
        print(_overview(), file=sys.stderr)
        print(f"\nringserve worker: --role is required (one of {', '.join(ROLES)})", file=sys.stderr)
        return 2
    parser = _parser(known.role)
    if known.help:
        parser.print_help()
        return 0
    try:
        actor_argv = role_argv(known.role, rest)
    except ValueError as exc:
        parser.error(str(exc))
    args = parser.parse_args(actor_argv)  # errors and --help name `ringserve worker --role R`
    try:
        Subjects(args.namespace)
    except ValueError as exc:
        parser.error(str(exc))
    _module(known.role).main(actor_argv)  # runs the actor; exits with its code
    return 0
