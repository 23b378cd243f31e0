"""Tracing on a real ring (tiny model; the small ring, shared with other files) exporting straight to a local
OTLP/HTTP receiver: one request is one trace across the processes, rooted at the HTTP request under the client's
traceparent, with the messaging spans named after subject templates, the scheduler's steps linked to it, and
errors and aborts marked."""

from __future__ import annotations

import json
from typing import Callable

import httpx
import pytest

from ringserve.observability.otlp_decode import SpanRecord
from tests.otlp_receiver import OtlpReceiver
from tests.server_helpers import ServerHandle

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
REQUEST_SPANS = {"send req.submit", "process req.submit", "tokenize", "send req.tokenized", "process req.tokenized",
                 "generate", "queue", "prefill", "decode", "detokenize", "stream to client"}


@pytest.fixture
def traced(small_ring: ServerHandle, small_ring_spans: OtlpReceiver) -> tuple[ServerHandle, OtlpReceiver]:
    """The small ring (shared with other files, tests/shared_rings.py) and the receiver of its spans."""
    return small_ring, small_ring_spans


def complete(trace_id: str, root: str) -> Callable[[list[SpanRecord]], bool]:
    """Whether the spans hold request trace `trace_id` with every span the ring makes for one request."""

    def check(spans: list[SpanRecord]) -> bool:
        names = {s.name for s in spans if s.trace_id == trace_id}
        return root in names and REQUEST_SPANS <= names
    return check


def one(spans: list[SpanRecord], name: str) -> SpanRecord:
    [span] = [s for s in spans if s.name == name]
    return span


def test_one_request_is_one_trace_across_four_processes(traced: tuple[ServerHandle, OtlpReceiver]) -> None:
    server, receiver = traced
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "temperature": 0.5,
            "top_p": 0.9, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60,
                      headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    receiver.wait_for(complete(CLIENT_TRACE, "POST /v1/chat/completions"))
    spans = receiver.trace(CLIENT_TRACE)
    assert len({s.span_id for s in spans}) == len(spans), "a span arrived twice"

    root = one(spans, "POST /v1/chat/completions")
    assert root.parent_id == CLIENT_SPAN and root.kind == "server"  # the client's traceparent is the parent
    rid = root.attributes["ringserve.rid"]
    # every process is its own resource; entry, tokenizer, scheduler and detokenizer all appear in this trace
    assert {s.service for s in spans} >= {"ringserve-entry", "ringserve-tokenizer", "ringserve-scheduler",
                                          "ringserve-detokenizer"}
    assert len({s.process for s in spans}) >= 4 and len({s.resource["process.pid"] for s in spans}) >= 4
    by_id = {s.span_id: s for s in spans}
    assert all(s.parent_id in by_id for s in spans if s is not root), "a span whose parent is not in the trace"

    def parent(name: str) -> str:
        return by_id[one(spans, name).parent_id].name

    assert parent("send req.submit") == "POST /v1/chat/completions"
    assert parent("process req.submit") == "send req.submit"
    assert parent("tokenize") == "process req.submit" and parent("send req.tokenized") == "process req.submit"
    assert parent("process req.tokenized") == "send req.tokenized"
    assert parent("generate") == "process req.tokenized"
    assert parent("queue") == parent("prefill") == parent("decode") == "generate"
    assert parent("detokenize") == "generate" and one(spans, "detokenize").service == "ringserve-detokenizer"
    assert parent("stream to client") == "POST /v1/chat/completions"
    assert one(spans, "prefill").events[0].name == "prefill chunk"
    assert one(spans, "decode").attributes["gen_ai.usage.output_tokens"] == 6

    # the root carries what an operator asks first
    usage = [json.loads(line[6:]) for line in lines[:-1]]
    assert root.attributes["gen_ai.usage.output_tokens"] == 6
    prompt_tokens = one(spans, "generate").attributes["gen_ai.usage.input_tokens"]
    assert root.attributes["gen_ai.usage.input_tokens"] == prompt_tokens > 0
    assert "gen_ai.usage.cache_read.input_tokens" in root.attributes
    assert root.attributes["gen_ai.request.max_tokens"] == 6 and root.attributes["gen_ai.request.temperature"] == 0.5
    assert root.attributes["gen_ai.request.top_p"] == 0.9
    assert 0 < root.attributes["gen_ai.server.time_to_first_token"] <= root.attributes["gen_ai.server.request.duration"]
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"] and usage[0]["id"].endswith(rid)

    # messaging spans follow the conventions, named by template, never by the rid's own subject
    messaging = [s for s in receiver.snapshot() if "messaging.system" in s.attributes]
    assert messaging and all(s.attributes["messaging.system"] == "nats" for s in messaging)
    for s in messaging:
        operation = s.attributes["messaging.operation.type"]
        assert s.name == f"{operation} {s.attributes['messaging.destination.template']}"
    assert not [s.name for s in receiver.snapshot() if rid in s.name]

    # scheduler steps are traces of their own, linked to the request's generate span
    generate = one(spans, "generate")
    steps = [s for s in receiver.snapshot() if s.name == "scheduler step"
             and (CLIENT_TRACE, generate.span_id) in s.links]
    assert steps and all(s.trace_id != CLIENT_TRACE and not s.parent_id for s in steps)
    sends = [s for s in receiver.snapshot() if s.name == "send tokens.{shard}" and s.parent_id in
             {step.span_id for step in steps}]
    assert sends and any(p.name == "process tokens.{shard}" and p.parent_id in {s.span_id for s in sends}
                         for p in receiver.snapshot())


def test_errors_and_aborts_mark_their_spans(traced: tuple[ServerHandle, OtlpReceiver]) -> None:
    server, receiver = traced
    bad = httpx.post(f"{server.base_url}/generate", json={"rid": "bad1", "text": "x",
                                                          "sampling_params": {"temperature": -1}}, timeout=30)
    assert bad.status_code == 400
    spans = receiver.wait_for(lambda got: any(s.name == "POST /generate" and s.attributes.get("ringserve.rid") ==
                                              "bad1" for s in got))
    root = next(s for s in spans if s.attributes.get("ringserve.rid") == "bad1" and s.name == "POST /generate")
    assert root.status == "error" and root.attributes["http.response.status_code"] == 400
    # the tokenizer exports its own spans, in its own batches: they may come after the entry's
    spans = receiver.wait_for(lambda got: any(s.name == "tokenize" and s.trace_id == root.trace_id for s in got))
    tokenize = next(s for s in spans if s.name == "tokenize" and s.trace_id == root.trace_id)
    assert tokenize.status == "error" and "temperature" in tokenize.status_message

    body = {"rid": "gone1", "text": "Count", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with httpx.stream("POST", f"{server.base_url}/generate", json=body, timeout=60) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))  # then the client goes away
    spans = receiver.wait_for(lambda got: any(s.name == "generate" and s.attributes.get("ringserve.rid") == "gone1"
                                              for s in got) and any(s.name == "POST /generate" and
                                              s.attributes.get("ringserve.rid") == "gone1" for s in got))
    generate = next(s for s in spans if s.name == "generate" and s.attributes.get("ringserve.rid") == "gone1")
    assert generate.status == "error" and "abort" in generate.status_message
    root = next(s for s in receiver.trace(generate.trace_id) if s.name == "POST /generate")
    assert root.status == "error" and "abort" in root.status_message
