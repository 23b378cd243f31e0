"""The grammar warm-up on a real ring (the small ring, tiny model, `--grammar-warm-up` as every default start
has it; tests/shared_rings.py): the scheduler's compiler and the tokenizer's checker are warm before the ring
reports ready, so a JSON-schema request after ready neither makes a compiler or checker nor starts a compile
worker (each of which says so in the log, and the scheduler's wait on the request's trace), and its answer
follows the schema. Each compiler's vocabulary comes from ringserve's cache or is made for it
(actors/common/grammar_vocab.py), as both actors' ready lines say."""

from __future__ import annotations

import json
import re
import uuid

import httpx

from ringserve.kernels.grammar.compile_pool import WORKER_WAIT_NOTE
from tests.otlp_receiver import OtlpReceiver
from tests.server_helpers import ServerHandle

SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}},
          "required": ["colour"], "additionalProperties": False}


def test_the_first_schema_request_after_ready_waits_for_no_compiler_and_no_worker_start(
        small_ring: ServerHandle, small_ring_spans: OtlpReceiver) -> None:
    before_ready = small_ring.log().partition("ringserve is ready")[0]
    assert re.search(r"\[scheduler0\] grammar compiler warm", before_ready), before_ready[-3000:]
    assert re.search(r"\[tokenizer\] grammar checker warm", before_ready), before_ready[-3000:]
    for actor in ("scheduler0", "tokenizer"):  # each compiler's vocabulary: read from the cache, or made for it
        ready = re.search(rf"\[{actor}\] ready .*", before_ready)
        assert ready and "grammar vocabulary" in ready.group(0), before_ready[-3000:]

    schema = {**SCHEMA, "title": f"t{uuid.uuid4().hex}"}  # a schema no request compiled before
    body = {"messages": [{"role": "user", "content": "A colour?"}], "max_tokens": 24, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}
    trace_id = uuid.uuid4().hex
    response = httpx.post(f"{small_ring.base_url}/v1/chat/completions", json=body, timeout=120,
                          headers={"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"})
    assert response.status_code == 200, response.text
    answer = response.json()
    if answer["choices"][0]["finish_reason"] == "stop":  # a tiny random model may run out of tokens first
        assert set(json.loads(answer["choices"][0]["message"]["content"])) == {"colour"}

    log = small_ring.log()
    assert WORKER_WAIT_NOTE not in log, log[-3000:]
    assert "waited for its grammar check" not in log, log[-3000:]
    assert not re.search(r"waited for its grammar .*waited_for='the compiler being made'", log), log[-3000:]
    spans = small_ring_spans.wait_for(lambda got: any(s.trace_id == trace_id and s.name == "queue" for s in got))
    [queue] = [s for s in spans if s.trace_id == trace_id and s.name == "queue"]
    assert all(event.attributes.get("ringserve.grammar.waited_for") != "the compiler being made"
               for event in queue.events if event.name == "grammar wait")
