"""A local OTLP/HTTP trace receiver for tests: stdlib http.server + opentelemetry-proto decoding.

It answers `POST /v1/traces` (protobuf `ExportTraceServiceRequest`) with 200 and keeps every span, so a test
can stop it (the port then refuses connections, like a collector that is down) and start it again on the same
port. `spans` holds every span received, duplicates included (a test asserts there are none).
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from ringserve.bus.embedded_server import free_port
from ringserve.observability.otlp_decode import SpanRecord, decode_request


class OtlpReceiver:
    """Collects spans posted to http://127.0.0.1:{port}/v1/traces."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.spans: list[SpanRecord] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL to give as `--otlp-endpoint`."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "OtlpReceiver":
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = decode_request(body)
                with receiver._lock:
                    receiver.spans.extend(spans)
                    receiver.requests += 1
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the port: posts are refused until `start` again."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def snapshot(self) -> list[SpanRecord]:
        with self._lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[SpanRecord]:
        """The spans received for one trace."""
        return [s for s in self.snapshot() if s.trace_id == trace_id]

    def wait_for(self, done: Callable[[list[SpanRecord]], bool], timeout: float = 30.0) -> list[SpanRecord]:
        """Wait until `done(spans)` holds; returns the spans (raises TimeoutError with what arrived)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.snapshot()
            if done(spans):
                return spans
            time.sleep(0.1)
        names = sorted({s.name for s in self.snapshot()})
        raise TimeoutError(f"spans not complete after {timeout}s; {len(self.snapshot())} spans: {names}")

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
