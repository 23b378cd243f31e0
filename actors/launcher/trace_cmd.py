"""`ringserve trace RID`: a request's timeline as a waterfall in the terminal, from the JetStream span buffer.

Reads every span in the stream `{ns}-spans` (a consumer that acks nothing, so the trace exporter's progress
is untouched), keeps the trace(s) whose spans carry `ringserve.rid` = RID and prints them (observability/
waterfall.py). RID is the rid the ring used; an OpenAI response id `chatcmpl-X` / `cmpl-X` is tried as `X`.

Two ways to reach the buffer:
- while ringserve runs: `--nats-url` and the credentials of the trace_exporter role (the embedded server's
  launcher logs the whole command line, with `--nats-creds DIR/trace_exporter.json`);
- after it stopped, when it ran with `--trace-store DIR`: `--trace-store DIR` starts a private temporary
  nats-server on that store (not while another server uses it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ringserve.actors.common import flag_fields
from ringserve.actors.common.actor_flags import NatsAuthFlags, add_nats_auth_arguments, credentials_from_args
from ringserve.actors.common.flag_fields import flag
from ringserve.actors.common.help_format import DefaultOnceFormatter
from ringserve.actors.launcher.trace_buffer import jetstream_block
from ringserve.bus.connection import BusConnection
from ringserve.bus.credentials import CredentialsError
from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.bus.permissions import inbox_prefix
from ringserve.bus.span_stream import read_span_stream
from ringserve.bus.subjects import Subjects
from ringserve.observability.otlp_decode import SpanRecord, decode_request
from ringserve.observability.waterfall import render, select_request

RESPONSE_ID_PREFIXES = ("chatcmpl-", "cmpl-")
RID_HELP = "the request id (as in `/generate`'s meta_info.id, or an OpenAI response id)"
WHERE = ("nats_url", "trace_store")  # one of them, the buffer's whereabouts


@dataclass
class TraceFlags:
    """The flags of `ringserve trace RID` but the NATS credentials (NatsAuthFlags); `--nats-url` and
    `--trace-store` exclude each other, and one is required."""

    nats_url: str | None = field(default=None, metadata=flag("the running deployment's NATS"))
    trace_store: str | None = field(default=None, metadata=flag(
        "a stopped deployment's `serve --trace-store DIR`", metavar="DIR"))
    namespace: str = field(default="ringserve", metadata=flag("the deployment's subject prefix"))
    steps: bool = field(default=False, metadata=flag("also list the scheduler steps linked to the request"))
    no_events: bool = field(default=False, metadata=flag("leave out span events (prefill chunks, ...)"))
    width: int = field(default=48, metadata=flag("width of the timeline bars"))


def add_trace_arguments(cmd: argparse.ArgumentParser) -> None:
    """The argument and flags of `ringserve trace`: RID, then TraceFlags' (the NATS credentials after
    --namespace)."""
    cmd.add_argument("rid", help=RID_HELP)  # the one positional: not a flag
    flag_fields.add_exclusive_arguments(TraceFlags, cmd, WHERE, required=True)
    flag_fields.add_arguments(TraceFlags, cmd, names=("namespace",))
    add_nats_auth_arguments(cmd)
    flag_fields.add_arguments(TraceFlags, cmd, names=("steps", "no_events", "width"))


def add_trace_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register the `trace` subcommand."""
    cmd = commands.add_parser("trace", help="print a request's trace as a terminal waterfall (needs "
                                            "`serve --trace-buffer jetstream`)",
                              formatter_class=DefaultOnceFormatter)
    add_trace_arguments(cmd)


def trace_argv(rid: str, flags: TraceFlags, auth: NatsAuthFlags | None = None) -> list[str]:
    """The arguments of `ringserve trace` (after `trace`) that print `rid`'s waterfall from where `flags` say."""
    return [rid, *flag_fields.to_argv(flags), *flag_fields.to_argv(auth or NatsAuthFlags())]


def read_hint(url: str, namespace: str, creds_dir: Path | None) -> str:
    """The command that prints a request's waterfall from this deployment's span buffer."""
    creds = str(creds_dir / "trace_exporter.json") if creds_dir is not None else None
    return " ".join(["ringserve", "trace", *trace_argv("RID", TraceFlags(nats_url=url, namespace=namespace),
                                                       NatsAuthFlags(nats_creds=creds))])


async def load_spans(url: str, namespace: str, args: argparse.Namespace) -> list[SpanRecord]:
    """Every span in the deployment's span stream."""
    subjects = Subjects(namespace)
    bus = await BusConnection.connect(url, "ringserve-trace", max_reconnect_attempts=0,
                                      credentials=credentials_from_args(args),
                                      inbox_prefix=inbox_prefix(namespace, "trace_exporter"))
    try:
        spans: list[SpanRecord] = []
        async for data in read_span_stream(bus.client.jetstream(), subjects):
            spans.extend(decode_request(data))
        return spans
    finally:
        await bus.close()


def candidate_rids(rid: str) -> list[str]:
    """`rid`, and the ring rid inside an OpenAI response id."""
    return [rid] + [rid[len(p):] for p in RESPONSE_ID_PREFIXES if rid.startswith(p) and len(rid) > len(p)]


def trace_command(args: argparse.Namespace) -> int:
    """Print the waterfall(s) of `args.rid`; the exit code (1: no such request in the buffer, 2: unreachable)."""
    server = None
    try:
        url = args.nats_url
        if args.trace_store:
            store = Path(args.trace_store)
            if not store.is_dir():
                print(f"ringserve: {store} is not a directory", file=sys.stderr)
                return 2
            server = EmbeddedNatsServer(extra_config=jetstream_block(store.resolve())).start()
            url = server.url
        spans = asyncio.run(load_spans(url, args.namespace, args))
    except (CredentialsError, ValueError) as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # no server, no JetStream, no stream, refused
        print(f"ringserve: could not read the span buffer of namespace {args.namespace!r}: {exc!r}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.stop()
    for rid in candidate_rids(args.rid):
        traces = select_request(spans, rid)
        if traces:
            print("\n\n".join(render(t, args.width, args.steps, not args.no_events) for t in traces))
            return 0
    print(f"ringserve: no spans of request {args.rid!r} among the {len(spans)} buffered spans", file=sys.stderr)
    return 1
