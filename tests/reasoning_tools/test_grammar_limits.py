"""Grammar compilation bounded in time and memory (kernels/grammar: compile_pool, compile_worker,
schema_recursion), on SmolLM2's real tokenizer and real xgrammar worker processes.

A JSON schema only an infinite value satisfies is refused at once; a grammar that forces an unbounded text is
refused by the worker under its memory cap, and the calling process's memory stays put; a compile past the time
limit kills its worker and the next one compiles, while a worker kept off the CPU past the limit (a busy host)
is not failed; what xgrammar prints about a client's grammar never reaches
this process's stderr.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ringserve.kernels.grammar import GrammarCompiler, GrammarError, GrammarSpec, make_compiler
from ringserve.kernels.grammar.ebnf_productive import unproductive_rule
from ringserve.kernels.grammar.schema_recursion import infinite_subschema

MODEL_VOCAB = 49152
NODE = {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}
UNSATISFIABLE = {"$defs": {"n": {**NODE, "required": ["c"]}}, "$ref": "#/$defs/n"}
OPTIONAL = {"$defs": {"n": NODE}, "$ref": "#/$defs/n"}
FORGED = "zzz\n22:40:00.000 ERROR [launcher] FORGED LINE admin password=hunter2"


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("SmolLM2-135M-Instruct"))


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Iterator[GrammarCompiler]:
    compiler = make_compiler(tokenizer, MODEL_VOCAB, time_limit=60.0)
    yield compiler
    compiler.close()


def test_unsatisfiable_required_recursion_is_refused_at_once(compiler: GrammarCompiler) -> None:
    before, started = rss_bytes(), time.monotonic()
    for call in (compiler.check, compiler.compile):
        with pytest.raises(GrammarError, match=r"only an infinitely nested value could match '#/\$defs/n'"):
            call(GrammarSpec("json_schema", json.dumps(UNSATISFIABLE)))
    assert time.monotonic() - started < 5
    assert rss_bytes() - before < 300 << 20


def test_the_recursion_optional_schema_still_compiles(compiler: GrammarCompiler) -> None:
    compiled = compiler.compile(GrammarSpec("json_schema", json.dumps(OPTIONAL)))
    matcher = compiled.matcher()
    assert matcher.jump_forward() == "{"


@pytest.mark.parametrize("schema, where", [
    (UNSATISFIABLE, "#/$defs/n"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "#/properties/a"),
    ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, "#/items"),
    # an optional property that leads into a required loop: a model entering it would never finish
    ({"type": "object", "properties": {"x": {"type": "object", "properties": {"y": {"$ref": "#/properties/x"}},
                                             "required": ["y"]}}}, "#/properties/x"),
    (OPTIONAL, None),
    ({"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["a"]}, None),
    ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, None),
    ({"type": "array", "items": {"$ref": "#"}}, None),
])
def test_infinite_subschema(schema: dict, where: str | None) -> None:
    assert infinite_subschema(schema) == where


def test_a_grammar_forcing_unbounded_text_is_refused_with_memory_bounded(compiler: GrammarCompiler) -> None:
    """`root ::= "a" root` compiles, but its forced text never ends (what jump-forward computes on the step
    path, growing memory until the process dies)."""
    before, started = rss_bytes(), time.monotonic()
    with pytest.raises(GrammarError, match="output of unbounded length"):
        compiler.compile(GrammarSpec("ebnf", 'root ::= "a" root'))
    assert time.monotonic() - started < 60
    assert rss_bytes() - before < 300 << 20
    assert compiler.compile(GrammarSpec("ebnf", 'root ::= "ok"')).matcher().jump_forward() == "ok"


def test_the_worker_address_space_cap_holds(compiler: GrammarCompiler) -> None:
    """The worker runs under RLIMIT_AS (read back from /proc); a compile needing more fails there, the
    calling process's memory stays put, and the next request gets a fresh worker that compiles."""
    from ringserve.kernels.grammar.compile_pool import WorkerFailure, WorkerPool

    setup = {"tokenizer_info": compiler.tokenizer_info.serialize_json(),  # type: ignore[attr-defined]
             "memory_bytes": 64 << 20, "max_threads": 1}
    pool = WorkerPool(setup, size=1, time_limit=60.0, on_stderr=lambda text: None)
    try:
        pool.start()
        [worker] = pool._idle
        with open(f"/proc/{worker.proc.pid}/limits") as limits:
            line = next(line for line in limits if line.startswith("Max address space"))
        assert int(line.split()[3]) == worker.limit_bytes
        before = rss_bytes()
        with pytest.raises(WorkerFailure) as failed:
            pool.request({"op": "compile", "kind": "regex", "source": "[a-z0-9]{0,2000}[A-Z]{0,2000}"})
        assert failed.value.reason in ("memory", "crashed")
        assert worker.proc.poll() is not None and rss_bytes() - before < 100 << 20
        assert "grammar" in pool.request({"op": "compile", "kind": "regex", "source": "(yes|no)"})
    finally:
        pool.close()


@pytest.mark.parametrize("kind, source, rule", [
    ("ebnf", 'root ::= "a" root', "root"),
    ("ebnf", 'root ::= "x" | "y" loop\nloop ::= "a" loop', "loop"),  # a dead branch the model may enter
    ("ebnf", 'root ::= [a-c]+ "q"? ("r" | "s"){2,5} x*\nx ::= "k" x', "x"),
    ("ebnf", 'root ::= "a" root | "b"', None),
    ("regex", "(ab|c)*d{2,3}[^x]", None),
    # an optional property whose object requires itself, reached through anyOf/allOf (past the schema check)
    ("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"anyOf": [{"type": "null"}, {"allOf": [{"$ref": "#/properties/b"}]}]},
        "b": {"type": "object", "properties": {"x": {"$ref": "#/properties/b"}}, "required": ["x"]}}}),
     "properties_b"),
    ("json_schema", json.dumps(OPTIONAL), None),
])
def test_unproductive_rules_in_xgrammars_grammar(kind: str, source: str, rule: str | None) -> None:
    import xgrammar as xgr

    grammar = (xgr.Grammar.from_ebnf(source, root_rule_name="root") if kind == "ebnf" else
               xgr.Grammar.from_regex(source) if kind == "regex" else
               xgr.Grammar.from_json_schema(source, any_whitespace=False, strict_mode=True))
    assert unproductive_rule(str(grammar)) == rule
    assert unproductive_rule(str(xgr.Grammar.builtin_json_grammar())) is None


def test_a_dead_branch_forcing_unbounded_text_is_refused_by_check(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec("ebnf", 'root ::= "x" | "y" loop\nloop ::= "a" loop')
    for call in (compiler.check, compiler.compile):
        with pytest.raises(GrammarError, match="unbounded length \\(rule 'loop'\\)"):
            call(spec)


def test_a_compile_past_the_time_limit_kills_its_worker(tokenizer: Any) -> None:
    compiler = make_compiler(tokenizer, MODEL_VOCAB, time_limit=0.05, compile_threads=1)
    try:
        started = time.monotonic()
        with pytest.raises(GrammarError, match=r"took more than 0.05 CPU seconds to compile"):
            compiler.compile(GrammarSpec("regex", "[a-z0-9]{0,2000}[A-Z]{0,2000}"))
        assert time.monotonic() - started < 10
        assert compiler.cache_len() == 1  # the failure is cached: the same grammar costs nothing again
    finally:
        compiler.close()


def test_the_limit_counts_cpu_time_not_a_starved_workers_wall_time(tokenizer: Any) -> None:
    compiler = make_compiler(tokenizer, MODEL_VOCAB, time_limit=1.0, compile_threads=1)
    try:
        worker = compiler._workers._idle[0]  # started eagerly: the one this compile gets
        os.kill(worker.proc.pid, signal.SIGSTOP)  # no CPU for it, as on a host whose cores are taken
        resume = threading.Timer(2.5, os.kill, (worker.proc.pid, signal.SIGCONT))
        resume.start()
        started = time.monotonic()
        compiled = compiler.compile(GrammarSpec("regex", "[a-z]{1,5}"))
        assert time.monotonic() - started > 2.0  # it did wait past the 1 s limit, and was not failed for it
        assert compiled.matcher() is not None
        resume.join()
    finally:
        compiler.close()


def test_what_xgrammar_prints_stays_out_of_stderr(compiler: GrammarCompiler, capfd: pytest.CaptureFixture) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": FORGED}}, "required": ["a"]}
    try:
        compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
    except GrammarError as exc:
        assert "\n" not in str(exc)
    out, err = capfd.readouterr()
    assert "FORGED" not in out + err


def test_error_messages_quote_a_bounded_escaped_part_of_the_grammar(compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError) as caught:
        compiler.compile(GrammarSpec("regex", "(" + "x\n" * 5000))
    assert len(str(caught.value)) < 600 and "\n" not in str(caught.value)


def test_a_worker_ends_with_the_process_that_started_it(compiler: GrammarCompiler) -> None:
    """A parent killed with SIGKILL (no close) leaves no compile worker behind."""
    import os
    import signal
    import subprocess
    import sys

    from tests.server_helpers import process_alive, wait_for

    script = ("import json, sys, time\n"
              "from ringserve.kernels.grammar.compile_pool import WorkerPool\n"
              "setup = json.loads(sys.stdin.readline())\n"
              "pool = WorkerPool(setup, size=1, time_limit=60.0, on_stderr=print)\n"
              "pool.start()\n"
              "print(pool._idle[0].proc.pid, flush=True)\n"
              "time.sleep(600)\n")
    setup = {"tokenizer_info": compiler.tokenizer_info.serialize_json(),  # type: ignore[attr-defined]
             "memory_bytes": 1 << 30, "max_threads": 1}
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.write(json.dumps(setup) + "\n")
        parent.stdin.flush()
        worker_pid = int(parent.stdout.readline())
        assert process_alive(worker_pid)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert wait_for(lambda: not process_alive(worker_pid), timeout=10), "the compile worker outlived its parent"
