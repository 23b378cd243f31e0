"""The engine's grammar warm-up (actors/engine/scheduling/grammar.py `GrammarManager.warm_up`), in-process with
the real xgrammar backend and its compile worker processes: a warmed manager compiles its first JSON schema with
the compiler already made and a worker running, says nothing about waiting, and starts its other worker; a cold
one makes the compiler with its first constrained request and says so, with the rid, in the log and as an event
on the request's trace (actors/scheduler/request_spans.py)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest

from ringserve.bus.messages import TokenizedRequest
from ringserve.bus.params import SamplingParams

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"]}
VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from ringserve.actors.common.model_source import DEFAULT_MODEL, resolve_model
    from ringserve.actors.common.text_tokenizer import load_text_model

    return load_text_model(resolve_model(DEFAULT_MODEL)).tokenizer  # what the scheduler's engine holds


def schema_request(rid: str, title: str) -> Any:
    from ringserve.actors.engine.scheduling.request import Req

    params = SamplingParams(max_new_tokens=8, json_schema=json.dumps({**SCHEMA, "title": title}))
    return Req(rid, 1, [5], params, seed=0)


def compiled(manager: Any) -> tuple[list[Any], list[Any]]:
    ready: list[Any] = []
    failed: list[Any] = []
    while manager.pending:
        manager.wait(1.0)
        more, bad = manager.collect()
        ready += more
        failed += bad
    return ready, failed


def test_a_warmed_manager_compiles_its_first_schema_with_the_compiler_made_and_a_worker_running(
        tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    from ringserve.actors.engine.scheduling.grammar import GrammarManager

    manager = GrammarManager(tokenizer, VOCAB, 30.0)
    assert manager.warm_state() == "cold"
    assert manager.warm_up() is manager.warm_up()
    assert manager.wait_warm(300.0) == "warm"
    compiler = manager._compiler
    assert compiler is not None and compiler.done()  # made before the first request
    assert compiler.result()._workers.running() >= 1 and compiler.result().cache_len() == 1  # json_object

    def no_second_compiler() -> Any:
        raise AssertionError("the first request made a compiler of its own")

    manager._make_compiler = no_second_compiler  # type: ignore[method-assign]
    req = schema_request("first", "warm")
    with caplog.at_level(logging.INFO, logger="engine.grammar"):
        assert manager.submit(req) is None
        ready, failed = compiled(manager)
    assert ready == [req] and not failed and req.matcher is not None
    assert manager._compiler is compiler
    assert not [r for r in caplog.records if "waited for its grammar" in r.getMessage()]
    workers = compiler.result()._workers
    deadline = time.monotonic() + 300.0
    while workers.running() < 2 and time.monotonic() < deadline:  # the other worker starts after the warm-up
        time.sleep(0.1)
    assert workers.running() == 2
    compiler.result().close()


def test_a_cold_first_request_says_what_it_waited_for_in_the_log_and_its_trace(
        tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ringserve.actors.engine.scheduling.grammar import GrammarManager
    from ringserve.actors.scheduler import request_spans
    from ringserve.observability import tracing

    memory = InMemorySpanExporter()
    tracing.install("scheduler", memory)
    try:
        spans = request_spans.create()
        manager = GrammarManager(tokenizer, VOCAB, 30.0)  # no warm-up: the first request makes the compiler
        manager.on_wait = spans.grammar_waited
        req = schema_request("cold-rid", "cold")
        spans.arrived(req.rid, "")
        spans.queued(TokenizedRequest(req.rid, [5], req.params))
        with caplog.at_level(logging.INFO, logger="engine.grammar"):
            assert manager.submit(req) is None
            ready, failed = compiled(manager)
        spans.close_all("test over")
    finally:
        tracing.shutdown()
    assert ready == [req] and not failed
    [line] = [r for r in caplog.records if "waited for its grammar" in r.getMessage()]
    fields = line.fields  # type: ignore[attr-defined]
    assert fields["rid"] == "cold-rid" and fields["waited_for"] == "the compiler being made"
    assert fields["waited_s"] > 1.0 and fields["compiler_s"] > 0 and fields["warm_up"] == "cold"
    finished = {s.name: s for s in memory.get_finished_spans()}
    assert finished["generate"].attributes["ringserve.grammar.wait_s"] == fields["waited_s"]
    [event] = [e for e in finished["queue"].events if e.name == "grammar wait"]
    assert event.attributes["ringserve.grammar.waited_for"] == "the compiler being made"
    manager._compiler.result().close()
