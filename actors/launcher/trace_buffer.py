"""The launcher's side of tracing: the flags it passes on, JetStream for the embedded server when the span buffer is
on, and the trace exporter actor.

With `--trace-buffer jetstream` the embedded nats-server runs with JetStream on, its file store in a private
temporary directory (deleted on exit) or in `--trace-store DIR` (kept, so the spans outlive the server and
`ringserve trace --trace-store DIR` can read them later). On a NATS you operate (`--nats-url`), JetStream
must be enabled there. The trace exporter starts before every other actor, so the span stream exists before
any actor publishes a span.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from ringserve.actors.common import flag_fields
from ringserve.actors.launcher.nats_auth import private_directory
from ringserve.actors.launcher.supervisor import ActorSpec
from ringserve.observability.tracing_config import TracingConfig, TracingFlags, config_from_args

EXPORTER_STAGE = -1  # before stage 0 (scheduler, tokenizers, detokenizers)


def jetstream_block(store_dir: Path) -> str:
    """The nats-server config that turns JetStream on with its file store in `store_dir`."""
    return f"jetstream {{\n  store_dir: {json.dumps(str(store_dir))}\n}}\n"


@dataclass
class TraceBuffer:
    """What one `ringserve serve` does for tracing."""

    config: TracingConfig
    store_dir: Path | None = None  # the embedded server's JetStream store
    temporary: bool = False  # delete store_dir on exit

    @property
    def on(self) -> bool:
        return self.config.buffer == "jetstream"

    def server_config(self, external: bool) -> str:
        """What the embedded nats-server's config needs (nothing unless the buffer is on)."""
        if not self.on or external:
            return ""
        if self.store_dir is None:
            self.store_dir, self.temporary = private_directory("ringserve-traces-"), True
        self.store_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        return jetstream_block(self.store_dir)

    def cleanup(self) -> None:
        """Delete a temporary store."""
        if self.temporary and self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)


def plan_trace_buffer(args: argparse.Namespace) -> TraceBuffer:
    """Validate the tracing flags (ValueError) and decide the buffer."""
    if args.trace_store and not args.trace_buffer:
        args.trace_buffer = "jetstream"
    if args.trace_store and args.nats_url:
        raise ValueError("--trace-store is for the embedded NATS; on your own NATS, JetStream's store is its own")
    config = config_from_args(args)
    if args.trace_store and config.buffer != "jetstream":
        raise ValueError("--trace-store needs --trace-buffer jetstream")
    return TraceBuffer(config, Path(args.trace_store).resolve() if args.trace_store else None)


def actor_tracing_argv(args: argparse.Namespace) -> list[str]:
    """The tracing flags every actor gets (its environment, with any OTEL_* variables, comes along too)."""
    return flag_fields.to_argv(flag_fields.from_args(TracingFlags, args))


def trace_exporter_specs(buffer: TraceBuffer, common: list[str]) -> list[ActorSpec]:
    """The trace exporter actor when the buffer is on, else none."""
    if not buffer.on:
        return []
    return [ActorSpec("trace_exporter", 0, "ringserve.actors.trace_exporter", list(common), stage=EXPORTER_STAGE)]
