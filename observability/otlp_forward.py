"""Send already-encoded OTLP trace requests (`ExportTraceServiceRequest` bytes) to a collector.

The trace exporter actor forwards what actors stored in the JetStream buffer with this: over OTLP/HTTP
(stdlib urllib, `Content-Type: application/x-protobuf`) or, with the `grpc` extra installed, OTLP/gRPC.
Headers come from `OTEL_EXPORTER_OTLP_TRACES_HEADERS` / `OTEL_EXPORTER_OTLP_HEADERS` (`k=v,k2=v2`).
Blocking: call it from a worker thread.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from ringserve.observability.tracing_config import TracingConfig


@dataclass
class ForwardResult:
    """What the collector did with one request: `accepted`, or rejected for good (`drop`), or retry later."""

    accepted: bool
    drop: bool = False  # the collector refused the data itself (retrying cannot help)
    detail: str = ""


def otlp_headers(env: Any = None) -> dict[str, str]:
    """The extra headers the OTEL_* variables ask for."""
    env = os.environ if env is None else env
    raw = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS") or ""
    headers = {}
    for item in raw.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            headers[unquote(key.strip())] = unquote(value.strip())
    return headers


class OtlpForwarder:
    """Posts OTLP trace requests to the collector a TracingConfig names."""

    def __init__(self, config: TracingConfig, timeout: float = 10.0) -> None:
        self.config = config
        self.timeout = timeout
        self._headers = otlp_headers()
        self._stub: Any = None

    def send(self, body: bytes) -> ForwardResult:
        """Send one (possibly concatenated: protobuf merges repeated fields) ExportTraceServiceRequest."""
        if self.config.protocol == "grpc":
            return self._send_grpc(body)
        request = urllib.request.Request(self.config.traces_url, data=body, method="POST",
                                         headers={"Content-Type": "application/x-protobuf", **self._headers})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read()
                return ForwardResult(accepted=True, detail=str(response.status))
        except urllib.error.HTTPError as exc:
            # OTLP: a 400 is permanent (the data is bad); anything else (429, 503, a proxy's 404) may pass later
            return ForwardResult(accepted=False, drop=exc.code == 400, detail=f"HTTP {exc.code}")
        except (OSError, ValueError) as exc:  # refused, unreachable, timed out
            return ForwardResult(accepted=False, detail=repr(exc))

    def _send_grpc(self, body: bytes) -> ForwardResult:
        import grpc
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

        if self._stub is None:
            url = urlsplit(self.config.traces_url if "://" in self.config.traces_url
                           else f"http://{self.config.traces_url}")
            target = url.netloc or url.path
            channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials()) if url.scheme == "https"
                       else grpc.insecure_channel(target))
            self._stub = TraceServiceStub(channel)
        try:
            self._stub.Export(ExportTraceServiceRequest.FromString(body), timeout=self.timeout,
                              metadata=list(self._headers.items()) or None)
            return ForwardResult(accepted=True)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            return ForwardResult(accepted=False, drop=code == grpc.StatusCode.INVALID_ARGUMENT, detail=str(code))
