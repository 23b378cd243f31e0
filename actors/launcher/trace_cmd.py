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
from pathlib import Path

from ringserve.actors.common.actor_flags import add_nats_auth_arguments, credentials_from_args
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


def add_trace_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register the `trace` subcommand."""
    cmd = commands.add_parser("trace", help="print a request's trace as a terminal waterfall (needs "
                                            "`serve --trace-buffer jetstream`)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cmd.add_argument("rid", help="the request id (as in `/generate`'s meta_info.id, or an OpenAI response id)")
    where = cmd.add_mutually_exclusive_group(required=True)
    where.add_argument("--nats-url", help="the running deployment's NATS")
    where.add_argument("--trace-store", metavar="DIR", help="a stopped deployment's `serve --trace-store DIR`")
    cmd.add_argument("--namespace", default="ringserve", help="the deployment's subject prefix")
    add_nats_auth_arguments(cmd)
    cmd.add_argument("--steps", action="store_true", help="also list the scheduler steps linked to the request")
    cmd.add_argument("--no-events", action="store_true", help="leave out span events (prefill chunks, ...)")
    cmd.add_argument("--width", type=int, default=48, help="width of the timeline bars")


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
