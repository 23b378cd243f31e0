"""The grammar backend (kernels/grammar) on SmolLM2's real tokenizer: masks, matchers, compile cache, bitmasks.

Generation here is greedy over random logits plus the grammar's mask (with a small bias towards closing
characters and a large one on eos, so every walk ends within a few dozen tokens): whatever the logits, the
mask alone must make the text parse, validate and match.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch

from ringserve.kernels.grammar import (GrammarCompiler, GrammarError, GrammarMatcher, GrammarSpec, allocate_bitmask,
                             apply_bitmask, fill_bitmasks, make_compiler, unpack_bitmask)

MODEL_VOCAB = 49152  # SmolLM2's config vocab_size (= its tokenizer's)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
}
REGEX = r"(cat|dog)s? [0-9]{2,4}-[a-z]{1,5}"
EBNF = 'root ::= answer ", " word\nanswer ::= "yes" | "no" | "maybe"\nword ::= [a-z]+'


@pytest.fixture(scope="module")
def tokenizer():
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("SmolLM2-135M-Instruct"))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> Iterator[GrammarCompiler]:
    compiler = make_compiler(tokenizer, MODEL_VOCAB)
    yield compiler
    compiler.close()


@pytest.fixture(scope="module")
def bias(tokenizer) -> torch.Tensor:
    pieces = tokenizer.convert_ids_to_tokens(list(range(MODEL_VOCAB)))
    bias = torch.tensor([3.0 if any(c in p for c in '"}],') else 0.0 for p in pieces])
    bias[tokenizer.eos_token_id] = 20.0
    return bias


def generate(compiler: GrammarCompiler, tokenizer, spec: GrammarSpec, bias: torch.Tensor, seed: int) -> str:
    """Greedy over seeded random logits, masked by the grammar, until the matcher terminates."""
    generator = torch.Generator().manual_seed(seed)
    matcher = compiler.compile(spec).matcher()
    bitmask = allocate_bitmask(1, MODEL_VOCAB)
    ids: list[int] = []
    while not matcher.is_terminated():
        assert len(ids) < 400, f"no end after 400 tokens: {tokenizer.decode(ids)!r}"
        matcher.fill_bitmask(bitmask, 0)
        logits = (torch.randn(MODEL_VOCAB, generator=generator) + bias)[None]
        apply_bitmask(logits, bitmask, [0])
        token = int(logits.argmax())
        assert matcher.accept_token(token), f"the mask allowed {token} but the matcher rejected it"
        ids.append(token)
    assert ids[-1] == tokenizer.eos_token_id
    return tokenizer.decode(ids[:-1])


def schema_spec(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def allowed_ids(matcher: GrammarMatcher) -> torch.Tensor:
    bitmask = allocate_bitmask(1, MODEL_VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, MODEL_VOCAB)[0]


@pytest.mark.parametrize("seed", range(3))
def test_json_object_output_parses(compiler, tokenizer, bias, seed: int) -> None:
    text = generate(compiler, tokenizer, GrammarSpec("json_object"), bias, seed)
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("seed", range(3))
def test_json_schema_output_validates(compiler, tokenizer, bias, seed: int) -> None:
    text = generate(compiler, tokenizer, GrammarSpec("json_schema", json.dumps(SCHEMA)), bias, seed)
    value = json.loads(text)
    assert list(value) == ["name", "age", "tags", "active"], text  # strict: exactly these, in order
    assert isinstance(value["name"], str) and len(value["name"]) <= 20
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(tag, str) and len(tag) <= 10 for tag in value["tags"])
    assert isinstance(value["active"], bool)


@pytest.mark.parametrize("seed", range(3))
def test_regex_output_fully_matches(compiler, tokenizer, bias, seed: int) -> None:
    text = generate(compiler, tokenizer, GrammarSpec("regex", REGEX), bias, seed)
    assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("seed", range(3))
def test_ebnf_choice_grammar(compiler, tokenizer, bias, seed: int) -> None:
    text = generate(compiler, tokenizer, GrammarSpec("ebnf", EBNF), bias, seed)
    assert re.fullmatch(r"(yes|no|maybe), [a-z]+", text), text


@pytest.mark.parametrize(("spec", "expected"), [
    (GrammarSpec("json_schema", "{not json"), "invalid JSON schema: not valid JSON"),
    (GrammarSpec("json_schema", '{"type": "objec"}'), 'invalid JSON schema: Unsupported type "objec"'),
    (GrammarSpec("json_schema", '{"type": "string", "pattern": "[a-"}'), "Unclosed '['"),
    (GrammarSpec("json_schema", "[]"), "Schema should be an object or bool"),
    (GrammarSpec("regex", "(abc"), "invalid regex: Regex parsing error at position 5: The parenthesis is not closed"),
    (GrammarSpec("ebnf", 'root ::= "a" | foo'),
     'invalid EBNF grammar: EBNF parser error at line 1, column 16: Rule "foo" is not defined'),
    (GrammarSpec("ebnf", 'start ::= "a"'), 'The root rule with name "root" is not found'),
])
def test_invalid_constraints_raise_grammar_error(compiler, spec: GrammarSpec, expected: str) -> None:
    for attempt in (compiler.check, compiler.compile, compiler.check, compiler.compile):  # cached the 2nd time
        with pytest.raises(GrammarError) as caught:
            attempt(spec)
        assert expected in str(caught.value) and "/project/cpp" not in str(caught.value)
        assert isinstance(caught.value, ValueError) and caught.value.kind == spec.kind


def test_spec_is_a_value_and_rejects_unknown_kinds() -> None:
    assert GrammarSpec("regex", "a+") == GrammarSpec("regex", "a+")
    assert len({GrammarSpec("regex", "a+"), GrammarSpec("regex", "a+"), GrammarSpec("json_object")}) == 2
    with pytest.raises(GrammarError, match="unknown grammar kind 'xml'"):
        GrammarSpec("xml", "<a/>")  # type: ignore[arg-type]
    with pytest.raises(GrammarError, match="json_object takes no source"):
        GrammarSpec("json_object", "{}")
    with pytest.raises(AttributeError):
        GrammarSpec("regex", "a").source = "b"  # type: ignore[misc]


def test_valid_specs_pass_check(compiler) -> None:
    for spec in (GrammarSpec("json_object"), GrammarSpec("json_schema", json.dumps(SCHEMA)),
                 GrammarSpec("regex", REGEX), GrammarSpec("ebnf", EBNF)):
        compiler.check(spec)


def test_compile_cache_returns_the_same_object_and_is_lru_bounded(tokenizer) -> None:
    compiler = make_compiler(tokenizer, MODEL_VOCAB, cache_size=2)
    try:
        first = compiler.compile(GrammarSpec("regex", "a+"))
        assert compiler.compile(GrammarSpec("regex", "a+")) is first
        assert first.compile_seconds > 0 and first.memory_bytes > 0 and first.vocab_size == MODEL_VOCAB
        compiler.compile(GrammarSpec("regex", "b+"))
        compiler.compile(GrammarSpec("regex", "a+"))  # a hit: now the most recently used
        compiler.compile(GrammarSpec("regex", "c+"))  # evicts b+
        assert compiler.cache_len() == 2 and compiler.compile(GrammarSpec("regex", "a+")) is first
    finally:
        compiler.close()


def test_compile_async_returns_a_future_of_the_cached_object(compiler) -> None:
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"x": {"type": "number"}}}))
    future = compiler.compile_async(spec)
    assert isinstance(future, Future)
    compiled = future.result(timeout=30)
    assert compiled is compiler.compile(spec) and compiled.spec == spec
    assert compiler.compile_async(spec).result(timeout=0) is compiled  # a hit is done at once
    bad = compiler.compile_async(GrammarSpec("regex", "(("))
    assert isinstance(bad.exception(timeout=30), GrammarError)


def test_rollback_and_reaccept_restore_the_state(compiler, tokenizer) -> None:
    ids = tokenizer.encode('{"name": "Ann", "age": 4', add_special_tokens=False)
    matcher = compiler.compile(schema_spec(SCHEMA)).matcher()
    assert all(matcher.accept_token(t) for t in ids) and matcher.accepted_tokens == tuple(ids)
    after_all = allowed_ids(matcher)
    matcher.rollback(3)
    assert matcher.accepted_tokens == tuple(ids[:-3])
    assert torch.equal(allowed_ids(matcher), allowed_ids(compiler.compile(schema_spec(SCHEMA)).matcher(ids[:-3])))
    assert all(matcher.accept_token(t) for t in ids[-3:])
    assert torch.equal(allowed_ids(matcher), after_all)
    with pytest.raises(ValueError, match="cannot roll back"):
        matcher.rollback(len(ids) + 1)
    matcher.reset()
    assert matcher.accepted_tokens == () and matcher.jump_forward() == '{"name": "'


def test_rebuilt_and_copied_matchers_give_the_same_next_mask(compiler, tokenizer) -> None:
    compiled = compiler.compile(GrammarSpec("json_object"))
    ids = tokenizer.encode('{"a": [1, {"b": "x', add_special_tokens=False)
    original = compiled.matcher()
    for t in ids:
        assert original.accept_token(t)
    rebuilt = compiled.matcher(original.accepted_tokens)
    assert torch.equal(allowed_ids(rebuilt), allowed_ids(original))
    copy = original.copy()
    assert copy.accept_token(tokenizer.encode('"', add_special_tokens=False)[0])
    assert not torch.equal(allowed_ids(copy), allowed_ids(original))  # independent states
    assert torch.equal(allowed_ids(rebuilt), allowed_ids(original))
    with pytest.raises(GrammarError, match="does not match the grammar"):
        compiled.matcher(tokenizer.encode("[1]", add_special_tokens=False))


def test_rejected_tokens_leave_the_state_unchanged(compiler, tokenizer) -> None:
    matcher = compiler.compile(GrammarSpec("regex", "[0-9]+")).matcher()
    before = allowed_ids(matcher)
    assert not matcher.accept_token(tokenizer.encode("x", add_special_tokens=False)[0])
    assert not matcher.accept_token(tokenizer.eos_token_id)  # nothing matched yet: no stop
    assert matcher.accepted_tokens == () and torch.equal(allowed_ids(matcher), before)


def test_termination_needs_the_eos_and_then_allows_only_stop_tokens(compiler, tokenizer) -> None:
    eos = tokenizer.eos_token_id
    matcher = compiler.compile(GrammarSpec("ebnf", 'root ::= "yes" | "no"')).matcher()
    assert matcher.stop_token_ids == (eos,)
    assert all(matcher.accept_token(t) for t in tokenizer.encode("yes", add_special_tokens=False))
    assert matcher.is_completed() and not matcher.is_terminated()
    assert allowed_ids(matcher).nonzero().flatten().tolist() == [eos]
    assert matcher.accept_token(eos) and matcher.is_terminated()
    assert allowed_ids(matcher).nonzero().flatten().tolist() == [eos]  # a late fill does not raise
    assert not matcher.accept_token(eos) and matcher.jump_forward() == "" and matcher.jump_forward_tokens() == []
    matcher.rollback(1)
    assert not matcher.is_terminated() and matcher.is_completed()


def test_special_tokens_are_never_allowed(compiler, tokenizer) -> None:
    matcher = compiler.compile(GrammarSpec("json_object")).matcher()
    for t in tokenizer.encode('{"free text', add_special_tokens=False):
        assert matcher.accept_token(t)
    allowed = allowed_ids(matcher)
    assert allowed.sum() > 40000  # almost any token can go inside a string ...
    specials = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    assert not any(allowed[i] for i in specials)  # ... but not <|im_start|>, <|endoftext|>, <file_sep>, ...


def test_a_padded_model_vocabulary_masks_the_padding_ids(tokenizer) -> None:
    compiler = make_compiler(tokenizer, MODEL_VOCAB + 64)
    matcher = compiler.compile(GrammarSpec("regex", "[a-z ]+")).matcher()
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, compiler.vocab_size)[0]
    assert compiler.vocab_size == MODEL_VOCAB + 64 and allowed[:MODEL_VOCAB].any()
    assert not allowed[MODEL_VOCAB:].any()


def test_jump_forward_returns_the_forced_text(compiler, tokenizer) -> None:
    matcher = compiler.compile(schema_spec(SCHEMA)).matcher()
    assert matcher.jump_forward() == '{"name": "'
    forced = matcher.jump_forward_tokens()
    assert forced and '{"name": "'.startswith(tokenizer.decode(forced))
    assert all(matcher.accept_token(t) for t in forced)
    rest = matcher.jump_forward()  # what the boundary token left out: the model picks how to spell it
    assert tokenizer.decode(forced) + rest == '{"name": "'
    for t in tokenizer.encode(rest + 'Bo", ', add_special_tokens=False):
        assert matcher.accept_token(t)
    assert matcher.jump_forward() == '"age": '
    assert compiler.compile(GrammarSpec("regex", "[ab]+")).matcher().jump_forward() == ""


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, so that NaNs compare equal to themselves."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_apply_bitmask_masks_constrained_rows_only(compiler, tokenizer) -> None:
    xgr = pytest.importorskip("xgrammar")
    batch, padded = 6, MODEL_VOCAB + 64  # a logits vocabulary padded past the tokenizer's
    rows = [1, 4, 5]
    specs = [GrammarSpec("json_object"), GrammarSpec("regex", REGEX), GrammarSpec("ebnf", EBNF)]
    bitmask = allocate_bitmask(batch, MODEL_VOCAB)
    fill_bitmasks([compiler.compile(s).matcher() for s in specs], bitmask, rows)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, padded, generator=generator)
    logits[0, 7], logits[2, 9] = float("nan"), float("inf")  # odd values in free rows stay as they are
    for dtype in (torch.float32, torch.bfloat16):
        for index in (rows, torch.tensor(rows)):
            original = logits.to(dtype)
            ours = original.clone()
            apply_bitmask(ours, bitmask, index)
            free = [r for r in range(batch) if r not in rows]
            assert torch.equal(raw_bits(ours[free]), raw_bits(original[free]))
            reference = original.clone()
            xgr.apply_token_bitmask_inplace(reference, bitmask, vocab_size=MODEL_VOCAB, indices=rows)
            assert torch.equal(raw_bits(ours[:, :MODEL_VOCAB]), raw_bits(reference[:, :MODEL_VOCAB]))
            assert torch.isneginf(ours[rows, MODEL_VOCAB:]).all()  # padding ids masked out
            allowed = unpack_bitmask(bitmask[rows], MODEL_VOCAB)
            assert torch.equal(ours[rows, :MODEL_VOCAB][allowed], original[rows, :MODEL_VOCAB][allowed])
    untouched = logits.clone()
    apply_bitmask(untouched, bitmask, [])
    assert torch.equal(raw_bits(untouched), raw_bits(logits))
    every = logits[:3].clone()
    apply_bitmask(every, bitmask[rows], None)
    assert torch.equal(every[:, :MODEL_VOCAB].isneginf(), ~unpack_bitmask(bitmask[rows], MODEL_VOCAB))


def test_importing_the_interface_does_not_import_xgrammar() -> None:
    code = "import sys, ringserve.kernels.grammar; assert 'xgrammar' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
