"""The `ringserve` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from ringserve.actors.common.help_format import DefaultOnceFormatter
from ringserve.actors.common.runtime import exit_now
from ringserve.actors.launcher.serve_flags import add_serve_arguments
from ringserve.actors.launcher.nats_config_cmd import add_nats_config_command, nats_config
from ringserve.actors.launcher.submit_cmd import add_submit_command, submit_command
from ringserve.actors.launcher.trace_cmd import add_trace_command, read_hint, trace_command
from ringserve.actors.launcher.worker_cmd import add_worker_command, worker_command
from ringserve.observability.logging import log_event, setup_logging

log = logging.getLogger("launcher")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `ringserve` and its subcommands."""
    parser = argparse.ArgumentParser(prog="ringserve", description="ringserve: an LLM server whose actors talk over NATS")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible API and /generate)",
                                formatter_class=DefaultOnceFormatter)
    add_serve_arguments(serve)
    add_nats_config_command(commands)
    add_trace_command(commands)
    add_submit_command(commands)
    add_worker_command(commands)
    return parser


def serve(args: argparse.Namespace) -> int:
    """`ringserve serve`: NATS (unless given), every actor, until Ctrl-C or an actor dies; the exit code."""
    from ringserve.actors.launcher.ring import Ring, RingError

    setup_logging("launcher", args.log_level)
    try:
        ring = Ring(args)
    except RingError as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    url, subjects, plan, trace = ring.url, ring.subjects, ring.plan, ring.trace
    try:
        try:
            ring.start_nats()
        except (OSError, RuntimeError) as exc:  # its port taken meanwhile, or the binary missing or failing
            print(f"ringserve: embedded nats-server: {exc}", file=sys.stderr)
            return 1

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
