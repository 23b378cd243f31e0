"""The grammar warm-up (actors/engine/scheduling/grammar.py `GrammarManager.warm_up`, the scheduler's early
start in actors/scheduler/grammar_warm.py, the tokenizer's checker in actors/tokenizer/grammar_check.py),
in-process with the real xgrammar backend and its compile worker processes: a worker process started before
the tokenizer is known (`prestart`) is the one the compiler then uses; a warmed manager compiles its first JSON
schema with the compiler already made and that one worker running, says nothing about waiting, and starts no
second worker; the engine's manager takes an early manager's warm compiler over; a cold one makes the compiler
with its first constrained request and says so, with the rid, in the log and as an event on the request's trace
(actors/scheduler/request_spans.py). The flag is on by default, `--no-grammar-warm-up` turns it off for the
scheduler and the tokenizer alike."""

from __future__ import annotations

import asyncio
import json
import logging
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
    from ringserve.actors.engine.core.request import Req

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
    from ringserve.kernels.grammar import compile_pool

    compile_pool.prestart()  # as the scheduler does before it loads the weights
    spare = compile_pool._spare
    assert spare is not None and spare.poll() is None
    early = GrammarManager(tokenizer, VOCAB, 30.0)
    assert early.warm_state() == "cold"
    assert early.warm_up() is early.warm_up()
    manager = GrammarManager(tokenizer, VOCAB, 30.0)  # the engine's, built after the weights
    assert manager.adopt(early) and manager.warm_state() != "cold"
    assert not GrammarManager(tokenizer, VOCAB + 64, 30.0).adopt(early)  # another vocabulary warms its own
    assert manager.wait_warm(300.0) == "warm"
    compiler = manager._compiler
    assert compiler is not None and compiler.done()  # made before the first request
    workers = compiler.result()._workers
    assert [w.proc.pid for w in workers._idle] == [spare.pid]  # the prestarted process, set up
    assert compiler.result().cache_len() == 1  # json_object

    def no_second_compiler() -> Any:
        raise AssertionError("the first request made a compiler of its own")

    manager._make_compiler = no_second_compiler  # type: ignore[method-assign]
    req = schema_request("first", "warm")
    with caplog.at_level(logging.INFO, logger="engine.grammar"):
        assert manager.submit(req) is None
        ready, failed = compiled(manager)
    assert ready == [req] and not failed and req.matcher is not None
    assert manager._compiler is compiler
    assert not [r for r in caplog.records if "waited for" in r.getMessage()]
    assert workers._count == 1  # no second worker (about 200 MB) until two compiles come together
    assert compile_pool.shed_idle_workers() >= 1 and workers.running() == 0  # the test suite's memory, per module
    again = schema_request("again", "after shedding")
    assert manager.submit(again) is None
    ready, failed = compiled(manager)  # the pool is still open: a request starts a worker again
    assert ready == [again] and not failed and workers.running() == 1
    compiler.result().close()


def test_the_tokenizers_checker_warms_before_its_first_check(tokenizer: Any,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    from ringserve.actors.tokenizer.grammar_check import GrammarChecker
    from ringserve.bus.errors import ApiError

    checker = GrammarChecker(tokenizer, VOCAB)
    assert checker.wait_warm(0) == "cold"
    assert checker.warm_up() is checker.warm_up()
    assert checker.wait_warm(300.0) == "warm"
    made = checker._compiler
    with caplog.at_level(logging.INFO):
        asyncio.run(checker.check(SamplingParams(max_new_tokens=8, json_schema=json.dumps(SCHEMA)), True, "r1"))
        with pytest.raises(ApiError) as refused:
            asyncio.run(checker.check(SamplingParams(max_new_tokens=8, json_schema='{"type": "no"}'), True, "r2"))
    assert refused.value.param == "response_format"
    assert checker._compiler is made
    assert not [r for r in caplog.records if "waited for" in r.getMessage()]
    made.close()


def test_the_warm_up_is_on_by_default_and_its_negative_form_turns_it_off_for_scheduler_and_tokenizer() -> None:
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.launcher.ring import actor_specs
    from ringserve.actors.launcher.serve_flags import serve_args
    from ringserve.actors.tokenizer.__main__ import build_parser

    assert EngineConfig().grammar_warm_up and EngineConfig().to_argv() == []
    assert EngineConfig(grammar_warm_up=False).to_argv() == ["--no-grammar-warm-up"]
    tokenizer_flags, argv = build_parser(), ["--nats-url", "nats://127.0.0.1:4222", "--model", "m"]
    assert tokenizer_flags.parse_args(argv).grammar_warm_up
    assert not tokenizer_flags.parse_args([*argv, "--no-grammar-warm-up"]).grammar_warm_up
    for flags, on in (({}, True), ({"grammar_warm_up": False}, False)):
        args = serve_args({"model": "m", **flags})
        assert args.grammar_warm_up is on
        specs = {spec.role: spec.args for spec in actor_specs(args, "m")}
        assert ("--no-grammar-warm-up" in specs["scheduler"]) is (not on)
        assert ("--no-grammar-warm-up" in specs["tokenizer"]) is (not on)


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
