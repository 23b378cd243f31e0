"""Tracing without a ring: configuration from flags and OTEL_* variables, subject templates as span names,
nothing started when tracing is off, the JetStream span exporter's dedupe, the forwarder, the waterfall."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ringserve.bus.subjects import Subjects, subject_template
from ringserve.observability.otlp_decode import SpanEvent, SpanRecord
from ringserve.observability.tracing_config import TracingConfig
from ringserve.observability.waterfall import render, select_request
from tests.otlp_receiver import OtlpReceiver
from tests.server_helpers import REPO


def test_flags_and_otel_variables_decide_whether_and_where_spans_go() -> None:
    assert not TracingConfig.resolve(env={}).enabled  # off by default
    on = TracingConfig.resolve("http://collector:4318", env={})
    assert on.enabled and on.traces_url == "http://collector:4318/v1/traces" and on.protocol == "http/protobuf"
    assert TracingConfig.resolve("http://c:4318/v1/traces", env={}).traces_url == "http://c:4318/v1/traces"
    env = TracingConfig.resolve(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"})
    assert env.enabled and env.traces_url == "http://jaeger:4318/v1/traces"
    full = TracingConfig.resolve(env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://j:4318/custom"})
    assert full.enabled and full.traces_url == "http://j:4318/custom"  # the signal URL is used as given
    grpc = TracingConfig.resolve(env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert grpc.enabled and grpc.protocol == "grpc" and grpc.traces_url == "http://localhost:4317"
    assert not TracingConfig.resolve(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4318",
                                          "OTEL_SDK_DISABLED": "true"}).enabled
    assert not TracingConfig.resolve(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4318",
                                          "OTEL_TRACES_EXPORTER": "none"}).enabled
    assert TracingConfig.resolve(env={"OTEL_TRACES_EXPORTER": "console"}).exporter == "console"
    buffered = TracingConfig.resolve(buffer="jetstream", env={"OTEL_SDK_DISABLED": "true"})
    assert buffered.enabled and buffered.buffer == "jetstream"  # a flag asks for it explicitly
    with pytest.raises(ValueError):
        TracingConfig.resolve(protocol="thrift", env={})


def test_spans_are_named_after_subject_templates_never_concrete_subjects() -> None:
    s = Subjects("ns")
    assert subject_template(s.output("rid-123")) == "out.{rid}"
    assert subject_template(s.output("alice~r9")) == "client.{client}.out.{rid}"
    assert subject_template(s.abort("alice~r9")) == "client.{client}.abort.{rid}"
    assert subject_template(s.abort("r9")) == "abort.{rid}"
    assert subject_template(s.tokens(3)) == "tokens.{shard}"
    assert subject_template(s.client_submit("bob")) == "client.{client}.submit"
    assert subject_template(s.submit) == "req.submit" and subject_template(s.tokenized) == "req.tokenized"
    assert subject_template(s.spans("entry")) == "spans.{role}"
    assert subject_template("_INBOX.ns.entry.abc.1") == "_INBOX"
    assert subject_template("ns.something.weird.x") == "(other)"


OFF_PROBE = """
import argparse, asyncio, sys, threading
from ringserve.actors.common.tracing_setup import start_tracing, stop_tracing
from ringserve.bus.connection import BusConnection
from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.bus.messages import AbortRequest
from ringserve.bus.subjects import Subjects
from ringserve.observability import tracing
from ringserve.actors.common.flag_fields import add_arguments
from ringserve.observability.tracing_config import TracingFlags

async def main():
    parser = argparse.ArgumentParser()
    add_arguments(TracingFlags, parser)
    args = parser.parse_args(sys.argv[1:])
    with EmbeddedNatsServer() as server:
        bus = await BusConnection.connect(server.url, "probe")
        on = await start_tracing(args, "tokenizer", 0, bus, Subjects("p"))
        got = asyncio.Event()
        async def handler(msg, delivery):
            got.set()
        await bus.subscribe("p.abort.r1", AbortRequest, handler)
        await bus.publish("p.abort.r1", AbortRequest(rid="r1"))
        await asyncio.wait_for(got.wait(), 5)
        threads = sorted(t.name for t in threading.enumerate())
        modules = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
        print("ON" if on else "OFF", tracing.enabled(), any(t.startswith("OtelBatch") for t in threads), len(modules))
        await stop_tracing()
        await bus.close()

asyncio.run(main())
"""


def run_probe(*flags: str) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}  # no OTEL_* variables from the caller
    out = subprocess.run([sys.executable, "-c", OFF_PROBE, *flags], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_tracing_off_installs_nothing_imports_no_sdk_and_starts_no_exporter_thread() -> None:
    """Off: a message still goes round, no provider, no OpenTelemetry module, no BatchSpanProcessor thread."""
    assert run_probe() == "OFF False False 0"
    with OtlpReceiver() as receiver:  # the same probe with tracing on does all three
        on, enabled, thread, modules = run_probe("--otlp-endpoint", receiver.url).split()
        assert (on, enabled, thread) == ("ON", "True", "True") and int(modules) > 0
        receiver.wait_for(lambda spans: {s.name for s in spans} >= {"send abort.{rid}", "process abort.{rid}"})


def test_jetstream_exporter_waits_for_the_ack_and_stores_a_retried_batch_once(tmp_path: Path) -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ringserve.actors.launcher.trace_buffer import jetstream_block
    from ringserve.bus.embedded_server import EmbeddedNatsServer
    from ringserve.bus.span_stream import ensure_span_stream, read_span_stream
    from ringserve.observability.jetstream_exporter import HEADROOM, JetStreamSpanExporter
    from ringserve.observability.otlp_decode import decode_request

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    for name in ("a", "b", "c"):
        provider.get_tracer("t").start_span(name).end()
    spans = memory.get_finished_spans()
    subjects = Subjects("u")

    async def scenario(url: str) -> list[SpanRecord]:
        import nats

        nc = await nats.connect(url)
        js = nc.jetstream()
        await ensure_span_stream(js, subjects)
        exporter = JetStreamSpanExporter(js, asyncio.get_running_loop(), subjects.spans("entry"), "p", nc.max_payload)
        results: list[object] = []

        def export_twice() -> None:  # the processor's thread; the same id twice, as a retry after a lost ack
            results.append(exporter._export(list(spans), "retried"))
            results.append(exporter._export(list(spans), "retried"))
            results.append(exporter.export(list(spans[:1])))

        worker = threading.Thread(target=export_twice)
        worker.start()
        while worker.is_alive():
            await asyncio.sleep(0.05)
        assert [str(r) for r in results] == ["SpanExportResult.SUCCESS"] * 3
        assert exporter.export(list(spans)).name == "FAILURE"  # never on the loop's own thread (a deadlock)
        one = len(encode_spans(spans[:1]).SerializeToString())
        small = JetStreamSpanExporter(js, asyncio.get_running_loop(), subjects.spans("entry"), "s",
                                      HEADROOM + one + 8)  # one span fits, two do not
        worker = threading.Thread(target=lambda: results.append(small.export(list(spans))))
        worker.start()  # too large together: the batch is halved until each part fits
        while worker.is_alive():
            await asyncio.sleep(0.05)
        assert str(results[-1]) == "SpanExportResult.SUCCESS" and small.exported_batches == 3
        stored = [s async for data in read_span_stream(js, subjects) for s in decode_request(data)]
        await nc.close()
        return stored

    with EmbeddedNatsServer(extra_config=jetstream_block(tmp_path / "js")) as server:
        stored = asyncio.run(scenario(server.url))
    # the retried batch once, the next batch once, the halved batch in parts
    assert sorted(s.name for s in stored) == ["a", "a", "a", "b", "b", "c", "c"]


def test_forwarder_reports_a_collector_that_is_down_as_retryable() -> None:
    from ringserve.observability.otlp_forward import OtlpForwarder

    receiver = OtlpReceiver()
    forwarder = OtlpForwarder(TracingConfig.resolve(receiver.url, env={}), timeout=2)
    down = forwarder.send(b"")
    assert not down.accepted and not down.drop
    with receiver:
        assert forwarder.send(b"").accepted


def _span(name: str, span_id: str, parent: str, start: int, end: int, service: str, trace: str = "t" * 32,
          **attributes: object) -> SpanRecord:
    return SpanRecord(trace, span_id, parent, name, "internal", start, end, dict(attributes),
                      {"service.name": f"ringserve-{service}", "service.instance.id": service, "process.pid": 1})


def test_waterfall_draws_the_tree_with_bars_events_and_linked_steps() -> None:
    ms = 1_000_000
    spans = [
        _span("POST /generate", "1" * 16, "", 0, 100 * ms, "entry", **{"ringserve.rid": "r1",
                                                                        "gen_ai.usage.output_tokens": 5}),
        _span("generate", "2" * 16, "1" * 16, 10 * ms, 90 * ms, "scheduler", **{"ringserve.rid": "r1"}),
        _span("decode", "3" * 16, "2" * 16, 40 * ms, 90 * ms, "scheduler"),
        _span("other request", "4" * 16, "", 0, 10 * ms, "entry", trace="f" * 32, **{"ringserve.rid": "r2"}),
    ]
    spans[1].events.append(SpanEvent("prefill chunk", 12 * ms, {"ringserve.prompt.tokens": 7}))
    step = _span("scheduler step", "5" * 16, "", 50 * ms, 55 * ms, "scheduler", trace="e" * 32)
    step.links.append(("t" * 32, "2" * 16))
    [trace] = select_request(spans + [step], "r1")
    assert [s.name for s in trace.spans] == ["POST /generate", "generate", "decode"] and trace.steps == [step]
    text = render(trace, width=20)
    lines = text.splitlines()
    assert "3 spans from 2 processes" in lines[0] and "completion tokens 5" in lines[0]
    body = [line for line in lines if "|" in line][1:]
    assert [line.split("|")[0].split()[-1] for line in body] == ["/generate", "generate", "decode"]
    assert body[0].count("█") == 20 and body[2].count("█") == 10  # decode: the second half of the timeline
    assert "prefill chunk ringserve.prompt.tokens=7" in text and "served by 1 scheduler steps" in text
    assert "scheduler step" in render(trace, width=20, show_steps=True)
    assert select_request(spans, "nope") == []


def test_otlp_grpc_exports_and_forwards_when_the_grpc_extra_is_installed() -> None:
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    from concurrent import futures

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ringserve.actors.common.tracing_setup import span_exporter
    from ringserve.bus.embedded_server import free_port
    from ringserve.observability.otlp_forward import OtlpForwarder

    got: list[str] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (gRPC's naming)
            got.extend(s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        config = TracingConfig.resolve(f"http://127.0.0.1:{port}", "grpc", env={})
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(span_exporter(config, None, Subjects("g"), "entry", 0)))
        provider.get_tracer("t").start_span("direct").end()  # the actors' direct exporter
        provider.shutdown()
        memory_provider = TracerProvider()
        memory = InMemorySpanExporter()
        memory_provider.add_span_processor(SimpleSpanProcessor(memory))
        memory_provider.get_tracer("t").start_span("forwarded").end()
        body = encode_spans(memory.get_finished_spans()).SerializeToString()
        assert OtlpForwarder(config).send(body).accepted  # the trace exporter's forwarder
    finally:
        server.stop(0)
    assert got == ["direct", "forwarded"]
