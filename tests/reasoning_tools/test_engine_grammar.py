"""Output constraints in the engine (json_schema, regex, ebnf through xgrammar), on a random-weight model
with SmolLM2's vocabulary and tokenizer: whatever the weights, the output must obey the grammar. Covers a
constrained row beside an unconstrained one, sampling with seeds, the overlap loop, jump-forward,
compilation failures and aborts."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from ringserve.bus.messages import TokenizedRequest
from ringserve.bus.params import SamplingParams
from tests.engine_helpers import engine_for, greedy, run_to_completion, tiny_hf_llama, tokens_of

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9},
                                           "colour": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "n", "colour"], "additionalProperties": False}
EOS = 2


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from ringserve.actors.common.model_source import DEFAULT_MODEL, load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_hf_llama(vocab_size=49152, max_position_embeddings=512)


def prompt(seed: int = 0) -> list[int]:
    return torch.randint(3, 49152, (7,), generator=torch.Generator().manual_seed(seed)).tolist()


def constrained(max_new: int = 48, temperature: float = 0.0, seed: int | None = None, **grammar: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=seed, stop_token_ids=[EOS],
                          **grammar)


def text_of(tokenizer: Any, rows: list[Any]) -> str:
    return tokenizer.decode(tokens_of(rows), skip_special_tokens=True)


def check_json(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"ok", "n", "colour"} and isinstance(value["ok"], bool)
    assert isinstance(value["n"], int) and 0 <= value["n"] <= 9 and value["colour"] in ("red", "green", "blue")


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_json_schema_output_is_valid_greedy_and_sampled(model: Any, tokenizer: Any, overlap: str) -> None:
    engine = engine_for(model, tokenizer, max_total_tokens=2048, overlap_schedule=overlap)
    schema = json.dumps(SCHEMA)
    reqs = [TokenizedRequest("greedy", prompt(), constrained(json_schema=schema))]
    reqs += [TokenizedRequest(f"s{seed}", prompt(seed), constrained(temperature=1.0, seed=seed, json_schema=schema))
             for seed in range(4)]
    out = run_to_completion(engine, reqs)
    for req in reqs:
        rows = out[req.rid]
        assert rows[-1].finish.type == "stop", (req.rid, rows[-1].finish)
        check_json(text_of(tokenizer, rows))
    engine.check_integrity()
    assert engine.stats().kv_running_tokens == 0


def test_an_unconstrained_neighbour_is_unchanged(model: Any, tokenizer: Any) -> None:
    free = TokenizedRequest("free", prompt(9), greedy(12))
    alone = tokens_of(run_to_completion(engine_for(model, tokenizer, max_total_tokens=2048), [free])["free"])
    engine = engine_for(model, tokenizer, max_total_tokens=2048)
    out = run_to_completion(engine, [TokenizedRequest("json", prompt(), constrained(json_schema=json.dumps(SCHEMA))),
                                     free])
    assert tokens_of(out["free"]) == alone
    check_json(text_of(tokenizer, out["json"]))


def test_regex_and_ebnf(model: Any, tokenizer: Any) -> None:
    engine = engine_for(model, tokenizer, max_total_tokens=2048)
    pattern = r"[a-z]{3}-[0-9]{2}"
    grammar = 'root ::= "yes" | "no" | "maybe so"'
    out = run_to_completion(engine, [TokenizedRequest("re", prompt(), constrained(regex=pattern)),
                                     TokenizedRequest("bnf", prompt(1), constrained(ebnf=grammar))])
    assert re.fullmatch(pattern, text_of(tokenizer, out["re"]))
    assert text_of(tokenizer, out["bnf"]) in ("yes", "no", "maybe so")


def test_max_tokens_cuts_the_json_short(model: Any, tokenizer: Any) -> None:
    engine = engine_for(model, tokenizer, max_total_tokens=2048)
    rows = run_to_completion(engine, [TokenizedRequest("short", prompt(), constrained(3, json_schema=json.dumps(SCHEMA)))])
    assert rows["short"][-1].finish.type == "length" and rows["short"][-1].completion_tokens == 3


def test_jump_forward_appends_forced_text_in_fewer_steps(model: Any, tokenizer: Any) -> None:
    """The forced tokens may split the text differently from the model's own choice (xgrammar picks them), so
    the token ids can differ from a run without jump-forward; the output must still obey the schema, and the
    keys the schema fixes must come without a decode step each."""
    schema = json.dumps(SCHEMA)
    reqs = [TokenizedRequest(f"j{i}", prompt(i), constrained(json_schema=schema)) for i in range(3)]
    slow = engine_for(model, tokenizer, max_total_tokens=2048, disable_jump_forward=True)
    fast = engine_for(model, tokenizer, max_total_tokens=2048)
    out_slow, out_fast = run_to_completion(slow, reqs), run_to_completion(fast, reqs)
    for req in reqs:
        check_json(text_of(tokenizer, out_fast[req.rid]))
        check_json(text_of(tokenizer, out_slow[req.rid]))
    assert slow.jumper is None and fast.jumper is not None and fast.jumper.tokens >= 3 * 3  # three fixed keys each
    # fewer emissions (one row per step that gave the request tokens); counting engine steps would count the
    # idle ones spent waiting for a grammar to compile, which a busy host lengthens
    assert sum(len(out_fast[r.rid]) for r in reqs) < sum(len(out_slow[r.rid]) for r in reqs)
    fast.check_integrity()
    assert fast.stats().kv_running_tokens == 0


def test_forced_tokens_spell_the_forced_text(tokenizer: Any) -> None:
    from ringserve.actors.engine.scheduling.grammar import GrammarManager
    from ringserve.actors.engine.core.request import Req

    manager = GrammarManager(tokenizer, 49152, 30.0)
    req = Req("r", 1, [5], constrained(json_schema=json.dumps(SCHEMA)), seed=0)
    assert manager.submit(req) is None
    while manager.pending:
        manager.wait(1.0)
        ready, failed = manager.collect()
    assert ready == [req] and not failed
    text = req.matcher.jump_forward()
    forced = manager.forced_tokens(req, room=100)
    assert text.startswith("{") and tokenizer.decode(forced) == text[:len(tokenizer.decode(forced))]
    assert manager.forced_tokens(req, room=0) == []


def test_a_bad_grammar_fails_its_request_only(model: Any, tokenizer: Any) -> None:
    engine = engine_for(model, tokenizer, max_total_tokens=2048)
    out = run_to_completion(engine, [TokenizedRequest("bad", prompt(), constrained(regex="[a-")),
                                     TokenizedRequest("good", prompt(1), greedy(4))])
    [row] = out["bad"]
    assert row.finish.type == "error" and row.finish.error.param == "regex"
    assert len(tokens_of(out["good"])) == 4 and not engine.live


def test_aborts_while_compiling_and_mid_grammar_free_everything(model: Any, tokenizer: Any) -> None:
    engine = engine_for(model, tokenizer, max_total_tokens=2048)
    schema = json.dumps({**SCHEMA, "title": "fresh"})  # not cached: still compiling right after add_request
    assert engine.add_request(TokenizedRequest("a", prompt(), constrained(json_schema=schema))) is None
    assert engine.abort("a").finish.type == "abort" and not engine.grammars.pending
    assert engine.add_request(TokenizedRequest("b", prompt(), constrained(json_schema=schema))) is None
    while not any(row.token_ids for row in engine.step()):
        pass
    assert engine.abort("b") is not None and not engine.has_work()
    engine.check_integrity()
    assert engine.stats().kv_running_tokens == 0


@pytest.mark.parametrize("jump_forward", [True, False])
def test_retraction_keeps_the_matcher_state(model: Any, tokenizer: Any, jump_forward: bool) -> None:
    """A pool too small for every request at once: retracted constrained requests resume where their grammar
    was, and every output still obeys the schema."""
    engine = engine_for(model, tokenizer, max_total_tokens=96, disable_jump_forward=not jump_forward)
    schema = json.dumps(SCHEMA)
    reqs = [TokenizedRequest(f"r{i}", prompt(i), constrained(temperature=1.0, seed=i, json_schema=schema))
            for i in range(5)]
    out = run_to_completion(engine, reqs)
    assert engine.counters.num_retractions > 0
    for req in reqs:
        check_json(text_of(tokenizer, out[req.rid]))
    assert engine.stats().kv_running_tokens == 0


def test_stop_strings_and_penalties_with_a_constraint(model: Any, tokenizer: Any) -> None:
    engine = engine_for(model, tokenizer, max_total_tokens=2048)
    stopped = TokenizedRequest("stop", prompt(), SamplingParams(max_new_tokens=32, temperature=0.0, stop=["-"],
                                                                stop_token_ids=[EOS], regex=r"[a-z]{3}-[0-9]{2}"))
    penalised = TokenizedRequest("pen", prompt(1), SamplingParams(
        max_new_tokens=48, temperature=1.0, seed=3, frequency_penalty=1.5, repetition_penalty=1.3,
        stop_token_ids=[EOS], json_schema=json.dumps(SCHEMA)))
    out = run_to_completion(engine, [stopped, penalised])
    assert out["stop"][-1].finish.type == "stop" and out["stop"][-1].finish.matched == "-"
    assert re.fullmatch(r"[a-z]{3}-?", text_of(tokenizer, out["stop"])), "the stop string ends it inside the grammar"
    check_json(text_of(tokenizer, out["pen"]))


def test_steps_run_while_the_first_constraint_loads_its_compiler(model: Any, tokenizer: Any) -> None:
    """The tokenizer export loads transformers' tokenizer (for xgrammar) with the first constrained request, on
    a thread of its own: an unconstrained request finishes meanwhile, and the constrained one follows."""
    import threading

    from ringserve.actors.common.model_source import DEFAULT_MODEL, resolve_model
    from ringserve.actors.common.text_tokenizer import TextTokenizer, load_text_model

    released = threading.Event()

    class HeldTokenizer(TextTokenizer):
        def transformers_tokenizer(self) -> Any:
            assert released.wait(60), "never released"
            return tokenizer

    exported = load_text_model(resolve_model(DEFAULT_MODEL)).tokenizer
    held = HeldTokenizer(exported.backend_tokenizer, {
        "chat_template": None, "special_tokens_map": exported.special_tokens_map, "eos_token_id": EOS,
        "bos_token_id": exported.bos_token_id, "all_special_ids": exported.all_special_ids, "length": len(exported)})
    engine = engine_for(model, held, max_total_tokens=2048)
    assert engine.add_request(TokenizedRequest("json", prompt(), constrained(json_schema=json.dumps(SCHEMA)))) is None
    assert engine.add_request(TokenizedRequest("free", prompt(9), greedy(6))) is None
    rows: dict[str, list[Any]] = {"json": [], "free": []}
    while not rows["free"] or rows["free"][-1].finish is None:
        for row in engine.step():
            rows[row.rid].append(row)
    assert rows["json"] == []  # still waiting for its compiler
    released.set()
    while engine.has_work():
        for row in engine.step():
            rows[row.rid].append(row)
    check_json(text_of(tokenizer, rows["json"]))
