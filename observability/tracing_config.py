"""Whether and where an actor exports spans: the tracing flags and the standard `OTEL_*` environment variables.

Tracing is off unless something turns it on: `--otlp-endpoint`, `--trace-buffer jetstream`, or the standard
variables `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_TRACES_EXPORTER`
(`otlp` or `console`; `none` keeps it off, as does `OTEL_SDK_DISABLED=true` unless a flag asks for tracing).
Flags win over variables. The endpoint is a base URL like `OTEL_EXPORTER_OTLP_ENDPOINT` (`/v1/traces` is
appended for OTLP/HTTP); `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is used as the full URL, as the spec says.

Nothing here imports OpenTelemetry: deciding that tracing is off costs no import.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

PROTOCOLS = ("http/protobuf", "grpc")
BUFFERS = ("none", "jetstream")
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318"
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
TRACES_PATH = "/v1/traces"


def _flag(help: str, **argparse_kwargs: Any) -> dict[str, Any]:
    """A tracing flag's field metadata, in the form actors/common/flag_fields.py reads (its help, `--help`
    group and argparse keywords; observability/ imports nothing else of ours, so the form is written here)."""
    return {"help": help, "group": "tracing", **argparse_kwargs}


@dataclass
class TracingFlags:
    """The tracing flags of `ringserve serve` and of every actor process (not given: the OTEL_* variables decide)."""

    otlp_endpoint: str | None = field(default=None, metadata=_flag(
        "export OpenTelemetry spans to this OTLP collector base URL, e.g. http://localhost:4318; not given: "
        "$OTEL_EXPORTER_OTLP_ENDPOINT, and tracing is off when neither is set", metavar="URL"))
    otlp_protocol: str | None = field(default=None, metadata=_flag(
        "OTLP transport; not given: $OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf (grpc needs `pip install "
        "ringserve[grpc]`)", choices=PROTOCOLS))
    trace_buffer: str | None = field(default=None, metadata=_flag(
        "jetstream: actors publish finished spans to a durable JetStream stream and one trace exporter forwards "
        "them to the collector, so a collector outage loses none", choices=BUFFERS))


@dataclass(frozen=True)
class TracingConfig:
    """Resolved tracing settings of one process."""

    enabled: bool = False
    exporter: str = "otlp"  # "otlp" or "console" (OTEL_TRACES_EXPORTER=console)
    protocol: str = "http/protobuf"
    traces_url: str = DEFAULT_HTTP_ENDPOINT + TRACES_PATH  # where OTLP spans go (HTTP: the full /v1/traces URL)
    buffer: str = "none"  # "jetstream": actors publish spans to a stream, the trace exporter forwards them

    @classmethod
    def resolve(cls, endpoint: str | None = None, protocol: str | None = None, buffer: str | None = None,
                env: Mapping[str, str] | None = None) -> "TracingConfig":
        """Combine the flags (None: not given) with the environment `env` (default: os.environ)."""
        env = os.environ if env is None else env
        buffer = buffer or "none"
        if buffer not in BUFFERS:
            raise ValueError(f"--trace-buffer must be one of {BUFFERS}, got {buffer!r}")
        protocol = (protocol or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
        if protocol not in PROTOCOLS:
            raise ValueError(f"the OTLP protocol must be one of {PROTOCOLS}, got {protocol!r}")
        exporter_env = (env.get("OTEL_TRACES_EXPORTER") or "").strip().lower()
        exporter = "console" if exporter_env == "console" else "otlp"
        full_url = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or "").strip()
        base_url = (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "").strip()
        if endpoint:
            url = _signal_url(endpoint, protocol)
        elif full_url:
            url = full_url
        else:
            url = _signal_url(base_url or (DEFAULT_GRPC_ENDPOINT if protocol == "grpc" else DEFAULT_HTTP_ENDPOINT),
                              protocol)
        asked = bool(endpoint) or buffer != "none"
        disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporter_env == "none"
        from_env = bool(full_url or base_url or exporter_env in ("otlp", "console"))
        enabled = asked or (from_env and not disabled)
        return cls(enabled=enabled, exporter=exporter if not asked else "otlp", protocol=protocol,
                   traces_url=url, buffer=buffer)


def _signal_url(base: str, protocol: str) -> str:
    """The traces URL of a base endpoint: HTTP appends `/v1/traces` (once); gRPC takes the base as it is."""
    base = base.strip()
    if protocol == "grpc" or base.rstrip("/").endswith(TRACES_PATH):
        return base
    return base.rstrip("/") + TRACES_PATH


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> TracingConfig:
    """The TracingConfig of a process started with the `TracingFlags` flags (raises ValueError)."""
    return TracingConfig.resolve(getattr(args, "otlp_endpoint", None), getattr(args, "otlp_protocol", None),
                                 getattr(args, "trace_buffer", None), env)
