"""Grammar compilation bounded in time and memory (kernels/grammar: compile_pool, compile_worker,
schema_recursion), on SmolLM2's real tokenizer and real xgrammar worker processes.

A JSON schema only an infinite value satisfies is refused at once; a grammar that forces an unbounded text is
refused by the worker under its memory cap, and the calling process's memory stays put; a compile past the time
limit kills its worker and the next one compiles; what xgrammar prints about a client's grammar never reaches
this process's stderr.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kernels.grammar import GrammarCompiler, GrammarError, GrammarSpec, make_compiler
from kernels.grammar.schema_recursion import infinite_subschema

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
    from actors.common.model_source import load_tokenizer, resolve_model

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


def test_a_grammar_forcing_unbounded_text_fails_in_the_worker_with_memory_bounded(
        compiler: GrammarCompiler) -> None:
    """`root ::= "a" root` compiles, but its forced text never ends (what jump-forward computes on the step
    path, growing memory until the process dies): the worker hits its cap, not this process."""
    before, started = rss_bytes(), time.monotonic()
    with pytest.raises(GrammarError, match="output of unbounded length"):
        compiler.compile(GrammarSpec("ebnf", 'root ::= "a" root'))
    assert time.monotonic() - started < 60
    assert rss_bytes() - before < 300 << 20
    # the killed worker is replaced: the next grammar compiles
    assert compiler.compile(GrammarSpec("ebnf", 'root ::= "ok"')).matcher().jump_forward() == "ok"


def test_a_compile_past_the_time_limit_kills_its_worker(tokenizer: Any) -> None:
    compiler = make_compiler(tokenizer, MODEL_VOCAB, time_limit=0.05, compile_threads=1)
    try:
        started = time.monotonic()
        with pytest.raises(GrammarError, match=r"took longer than 0.05 s to compile"):
            compiler.compile(GrammarSpec("regex", "[a-z0-9]{0,2000}[A-Z]{0,2000}"))
        assert time.monotonic() - started < 10
        assert compiler.cache_len() == 1  # the failure is cached: the same grammar costs nothing again
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
