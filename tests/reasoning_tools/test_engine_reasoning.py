"""Reasoning requests in the engine (bus/reasoning.py's `ReasoningPlan`, actors/engine/core/reasoning_gate.py):
the thinking budget forces the end marker, an output constraint applies only after the thinking, "before" lets
the model open its thinking or answer under the grammar, several-token markers, the overlap loop, the prefix
cache and speculative decoding. Random-weight models with token ids picked as fake markers: the thinking tokens
must be the model's own greedy tokens (checked against transformers), the answer must obey the grammar."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from ringserve.actors.engine.core.reasoning_gate import ReasoningGate, reasoning_gate
from ringserve.bus.messages import TokenizedRequest
from ringserve.bus.params import SamplingParams
from ringserve.bus.reasoning import ReasoningPlan
from tests.engine_helpers import (assert_greedy_matches, engine_for, greedy, hf_greedy, run_to_completion,
                                  tiny_hf_llama, tokens_of)

EOS = 2
PATTERN = r"[a-z]{3}-[0-9]{2}"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def plan(start: list[int], end: list[int], open: bool = False, budget: int | None = None) -> ReasoningPlan:
    return ReasoningPlan("test", "<think>", "</think>", start, end, open, budget)


def prompt(seed: int = 0, vocab: int = 512) -> list[int]:
    return torch.randint(3, vocab, (9,), generator=torch.Generator().manual_seed(seed)).tolist()


def unused(tokens: list[int], n: int, vocab: int = 512) -> list[int]:
    """`n` token ids (past the special ones) that `tokens` does not contain: markers the model does not write."""
    return [t for t in range(3, vocab) if t not in tokens][:n]


def run_one(engine: Any, request: TokenizedRequest) -> list[Any]:
    return run_to_completion(engine, [request])[request.rid]


def check_continues(hf: Any, prompt_ids: list[int], head: list[int], out: list[int]) -> None:
    """`out` is `head` followed by the model's greedy continuation of the prompt and `head`."""
    assert out[:len(head)] == head, (out, head)
    rest = out[len(head):]
    assert rest, "something follows the thinking"
    assert_greedy_matches(hf, prompt_ids + head, hf_greedy(hf, prompt_ids + head, len(rest), None), rest)


# --- without a grammar: the budget alone (a 512-token random model) ---------------------------------------------

@pytest.fixture(scope="module")
def free_out(hf: Any) -> list[int]:
    """The plain greedy output of `prompt()`, no plan."""
    return tokens_of(run_one(engine_for(hf), TokenizedRequest("free", prompt(), greedy(16))))


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("end_len", [1, 2])
def test_a_budget_forces_the_end_marker_right_after_k_thinking_tokens(hf: Any, free_out: list[int], overlap: str,
                                                                      end_len: int) -> None:
    k = 4
    end = unused(free_out, end_len)
    the_plan = plan([5], end, open=True, budget=k)
    engine = engine_for(hf, overlap_schedule=overlap)
    rows = run_one(engine, TokenizedRequest("r", prompt(), greedy(16), reasoning=the_plan))
    out = tokens_of(rows)
    assert out[:k] == free_out[:k], "the thinking is the model's own greedy output"
    assert out[k:k + end_len] == end, "then the end marker, forced"
    check_continues(hf, prompt(), free_out[:k] + end, out)
    assert rows[0].decode.reasoning == the_plan, "the first row carries the plan for the detokenizer"
    assert all(row.decode is None for row in rows[1:])
    assert (engine.counters.overlapped_steps > 0) == (overlap == "on")
    engine.check_integrity()
    assert engine.stats().kv_running_tokens == 0


def test_a_budget_of_zero_closes_the_thinking_at_once(hf: Any, free_out: list[int]) -> None:
    end = unused(free_out, 2)
    engine = engine_for(hf)
    opened = tokens_of(run_one(engine, TokenizedRequest("open", prompt(), greedy(12),
                                                        reasoning=plan([5], end, open=True, budget=0))))
    check_continues(hf, prompt(), end, opened)
    # a closed plan: the model opens the thinking itself (its greedy first token is the start marker here), and
    # the thinking closes right after it
    chosen = tokens_of(run_one(engine, TokenizedRequest("chosen", prompt(), greedy(12),
                                                        reasoning=plan([free_out[0]], end, budget=0))))
    check_continues(hf, prompt(), [free_out[0]] + end, chosen)
    # a start marker the model does not write: it answers at once, and the budget changes nothing
    answered = tokens_of(run_one(engine, TokenizedRequest("answered", prompt(), greedy(12),
                                                          reasoning=plan(unused(free_out, 3)[2:], end, budget=0))))
    assert answered == free_out[:12]


def test_a_closed_plan_thinks_when_the_model_opens_it_and_forces_the_rest_of_a_long_start(
        hf: Any, free_out: list[int]) -> None:
    k = 3
    second, end = unused(free_out, 2)
    engine = engine_for(hf)
    one = tokens_of(run_one(engine, TokenizedRequest("one", prompt(), greedy(14),
                                                     reasoning=plan([free_out[0]], [end], budget=k))))
    assert one[:1 + k] == free_out[:1 + k] and one[1 + k] == end
    check_continues(hf, prompt(), free_out[:1 + k] + [end], one)
    two = tokens_of(run_one(engine, TokenizedRequest("two", prompt(), greedy(14),
                                                     reasoning=plan([free_out[0], second], [end], budget=k))))
    assert two[:2] == [free_out[0], second], "the rest of the start marker is forced"
    thinking = hf_greedy(hf, prompt() + two[:2], k, None)
    assert_greedy_matches(hf, prompt() + two[:2], thinking, two[2:2 + k])
    assert two[2 + k] == end, "k thinking tokens, the markers not counted, then the end marker"
    check_continues(hf, prompt(), two[:2 + k] + [end], two)


def test_the_end_marker_the_model_writes_ends_the_thinking_before_the_budget(hf: Any, free_out: list[int]) -> None:
    """The end marker written by the model (here its own 3rd token) ends the thinking: no marker forced later."""
    end = free_out[2]
    assert end not in free_out[:2]
    engine = engine_for(hf)
    out = tokens_of(run_one(engine, TokenizedRequest("r", prompt(), greedy(16),
                                                     reasoning=plan([5], [end], open=True, budget=6))))
    assert out == free_out, "the budget was never spent"


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_requests_without_a_plan_or_without_anything_to_enforce_are_unchanged(hf: Any, free_out: list[int],
                                                                               overlap: str) -> None:
    end = unused(free_out, 1)
    engine = engine_for(hf, overlap_schedule=overlap)
    reqs = [TokenizedRequest("plain", prompt(), greedy(16)),
            TokenizedRequest("free_plan", prompt(), greedy(16), reasoning=plan([5], end, open=True)),
            TokenizedRequest("budget", prompt(1), greedy(16), reasoning=plan([5], end, open=True, budget=2)),
            TokenizedRequest("other", prompt(2), greedy(16))]
    out = run_to_completion(engine, reqs)
    assert tokens_of(out["plain"]) == free_out
    assert tokens_of(out["free_plan"]) == free_out, "a plan with neither grammar nor budget: nothing enforced"
    assert out["free_plan"][0].decode.reasoning is not None and out["plain"][0].decode.reasoning is None
    alone = tokens_of(run_one(engine_for(hf), TokenizedRequest("other", prompt(2), greedy(16))))
    assert tokens_of(out["other"]) == alone, "a neighbour's gate changes nothing for a plain request"
    assert tokens_of(out["budget"])[2] == end[0]
    assert reasoning_gate(plan([5], end, open=True), constrained=False) is None
    assert reasoning_gate(None, constrained=True) is None


def test_the_prefix_cache_serves_a_reasoning_request_again(hf: Any, free_out: list[int]) -> None:
    end = unused(free_out, 1)
    engine = engine_for(hf)
    request = TokenizedRequest("r", prompt(), greedy(12), reasoning=plan([5], end, open=True, budget=3))
    first = run_one(engine, request)
    again = run_one(engine, TokenizedRequest("r2", prompt(), greedy(12), reasoning=request.reasoning))
    assert tokens_of(again) == tokens_of(first) and tokens_of(first)[3] == end[0]
    assert first[0].cached_tokens == 0 and again[0].cached_tokens > 0
    # a request continuing the first one's thinking finds it in the cache
    longer = prompt() + tokens_of(first)[:3]
    cont = run_one(engine, TokenizedRequest("r3", longer, greedy(6), reasoning=plan([5], end, open=True, budget=0)))
    assert cont[0].cached_tokens >= len(prompt()) and tokens_of(cont)[0] == end[0]
    engine.check_integrity()


def test_no_drafts_while_thinking_and_greedy_output_unchanged_by_speculation(hf: Any) -> None:
    phrase = torch.randint(3, 512, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = phrase * 4
    k = 10
    plain = run_one(engine_for(hf, speculative_algorithm="ngram"), TokenizedRequest("p", seq, greedy(30)))
    assert plain[-1].spec_drafted_tokens > 0
    drafted_by_k = next(row.spec_drafted_tokens for row in plain if row.completion_tokens >= k)
    assert drafted_by_k > 0, "a plain request drafts within the first k tokens of this prompt"
    end = unused(seq + tokens_of(plain), 1)
    the_plan = plan([5], end, open=True, budget=k)
    off = tokens_of(run_one(engine_for(hf), TokenizedRequest("r", seq, greedy(30), reasoning=the_plan)))
    rows = run_one(engine_for(hf, speculative_algorithm="ngram"),
                   TokenizedRequest("r", seq, greedy(30), reasoning=the_plan))
    assert tokens_of(rows) == off and off[k] == end[0]
    assert all(row.spec_drafted_tokens == 0 for row in rows if row.completion_tokens <= k + 1), "none while thinking"


def test_sampled_requests_and_retraction_keep_to_the_budget(hf: Any, free_out: list[int]) -> None:
    """Seeded sampled requests under a pool too small for all of them: retracted requests resume in their phase,
    and every one writes the end marker right after its budget; the outputs are those of a roomy pool."""
    end = unused(free_out, 1)
    reqs = [TokenizedRequest(f"s{i}", prompt(i), SamplingParams(max_new_tokens=24, temperature=1.0, seed=i),
                             reasoning=plan([5], end, open=True, budget=3 + i)) for i in range(5)]
    small = engine_for(hf, max_total_tokens=96)
    out = run_to_completion(small, reqs)
    assert small.counters.num_retractions > 0
    roomy = run_to_completion(engine_for(hf), reqs)
    for i, req in enumerate(reqs):
        tokens = tokens_of(out[req.rid])
        assert tokens == tokens_of(roomy[req.rid]) and tokens[3 + i] == end[0], (req.rid, tokens)
    assert small.stats().kv_running_tokens == 0


def test_a_plan_the_engine_cannot_follow_is_refused(hf: Any) -> None:
    engine = engine_for(hf)
    outside = engine.add_request(TokenizedRequest("a", prompt(), greedy(4), reasoning=plan([5], [600], open=True)))
    assert outside is not None and "600" in outside.message
    endless = engine.add_request(TokenizedRequest("b", prompt(), greedy(4), reasoning=plan([5], [], budget=3)))
    assert endless is not None and "budget" in endless.message
    assert not engine.live


def test_the_gate_forces_only_the_rest_of_an_end_marker_the_thinking_already_began() -> None:
    gate = ReasoningGate(plan([5], [7, 8, 9], open=True, budget=3))
    assert [gate.feed(t) for t in (11, 12, 7)] == ["taken"] * 3
    assert gate.phase == "closing" and gate.thought == 3
    mask = torch.zeros(1, 1, dtype=torch.int32)
    assert gate.masks(constrained=False)
    gate.fill_bitmask(None, mask, 0)
    assert int(mask[0, 0]) == 1 << 8, "only the marker's next token, 8"
    assert gate.feed(9) == "refused"
    assert gate.feed(8) == "taken" and gate.feed(9) == "taken" and gate.answering
    assert gate.feed(13) == "answer"


def allowed(gate: ReasoningGate, vocab: int) -> set[int]:
    """The tokens `gate` lets through next, over `_Matcher`'s grammar."""
    from ringserve.kernels.grammar import allocate_bitmask, unpack_bitmask

    mask = allocate_bitmask(1, vocab)
    gate.fill_bitmask(_Matcher(), mask, 0)
    return set(torch.nonzero(unpack_bitmask(mask, vocab)[0]).flatten().tolist())


class _Matcher:
    """A grammar's first mask: token 40 only."""

    def fill_bitmask(self, mask: torch.Tensor, row: int) -> None:
        mask[row].zero_()
        mask[row, 1] = 1 << 8


def test_a_constrained_answer_may_open_with_whitespace_before_its_grammar() -> None:
    """Qwen3 writes `</think>\n\n` before its answer: the whitespace-only tokens right after the end marker bypass
    the grammar (at most MAX_LEADING_SPACE of them), and the first other token is the grammar's."""
    from ringserve.actors.engine.core.reasoning_gate import MAX_LEADING_SPACE, whitespace_tokens
    from ringserve.actors.common.model_source import DEFAULT_MODEL, load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    vocab = len(tokenizer)
    spacing = whitespace_tokens(tokenizer, vocab)
    newline, space, letter = tokenizer.encode("\n")[0], tokenizer.encode(" ")[0], tokenizer.encode("a")[0]
    assert {newline, space} <= spacing.ids and letter not in spacing.ids
    assert all(tokenizer.decode([t]).isspace() for t in spacing.ids)

    gate = reasoning_gate(plan([5], [7], open=True), constrained=True, spacing=spacing)
    assert gate is not None and gate.feed(7) == "taken" and gate.phase == "spacing"
    assert gate.masks(constrained=True)
    assert allowed(gate, vocab) == spacing.ids | {40}
    assert [gate.feed(newline), gate.feed(newline)] == ["taken", "taken"] and gate.phase == "spacing"
    assert gate.feed(40) == "answer" and gate.answering

    capped = reasoning_gate(plan([5], [7], open=True), constrained=True, spacing=spacing)
    assert capped is not None and capped.feed(7) == "taken"
    assert [capped.feed(space) for _ in range(MAX_LEADING_SPACE)] == ["taken"] * MAX_LEADING_SPACE
    assert allowed(capped, vocab) == {40}, "past the cap the grammar alone decides"
    assert capped.feed(40) == "answer"
    unconstrained = reasoning_gate(plan([5], [7], open=True, budget=4), constrained=False, spacing=spacing)
    assert unconstrained is not None and unconstrained.feed(7) == "taken" and unconstrained.answering


# --- with a grammar (SmolLM2's tokenizer and vocabulary, random weights) ---------------------------------------

@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from ringserve.actors.common.model_source import DEFAULT_MODEL, load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def big() -> Any:
    return tiny_hf_llama(vocab_size=49152, max_position_embeddings=512)


def constrained(max_new: int = 40, **grammar: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, stop_token_ids=[EOS], **grammar)


def text(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def big_free(big: Any, tokenizer: Any) -> list[int]:
    """The unconstrained greedy output of the big model's prompt."""
    rows = run_one(engine_for(big, tokenizer, max_total_tokens=2048),
                   TokenizedRequest("free", prompt(vocab=49152), constrained(12)))
    return tokens_of(rows)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_regex_applies_after_the_budget_closes_the_thinking(big: Any, tokenizer: Any, big_free: list[int],
                                                              overlap: str) -> None:
    k = 5
    p = prompt(vocab=49152)
    engine = engine_for(big, tokenizer, max_total_tokens=2048, overlap_schedule=overlap)
    at_once = tokens_of(run_one(engine, TokenizedRequest("at_once", p, constrained(regex=PATTERN))))
    assert re.fullmatch(PATTERN, text(tokenizer, at_once))
    assert at_once[:k] != big_free[:k], "the grammar would change the thinking if it applied from the start"
    end = unused(big_free, 1, 49152)
    rows = run_one(engine, TokenizedRequest("r", p, constrained(regex=PATTERN),
                                            reasoning=plan([5], end, open=True, budget=k)))
    out = tokens_of(rows)
    assert out[:k] == big_free[:k], "the thinking is free"
    assert out[k] == end[0]
    assert re.fullmatch(PATTERN, text(tokenizer, out[k + 1:])), "the answer obeys the grammar"
    assert rows[-1].finish.type == "stop"
    engine.check_integrity()
    assert engine.stats().kv_running_tokens == 0


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_json_schema_applies_after_the_end_marker_the_model_writes(big: Any, tokenizer: Any, big_free: list[int],
                                                                     overlap: str) -> None:
    end = big_free[3]  # the model's own 4th token closes its thinking
    assert end not in big_free[:3]
    engine = engine_for(big, tokenizer, max_total_tokens=2048, overlap_schedule=overlap)
    out = tokens_of(run_one(engine, TokenizedRequest("r", prompt(vocab=49152),
                                                     constrained(json_schema=json.dumps(SCHEMA)),
                                                     reasoning=plan([5], [end], open=True))))
    assert out[:4] == big_free[:4]
    value = json.loads(text(tokenizer, out[4:]))
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
    assert engine.jumper is not None and engine.jumper.tokens > 0, "jump-forward works once it answers"


def test_before_the_first_token_the_model_may_think_or_answer_under_the_grammar(
        big: Any, tokenizer: Any, big_free: list[int]) -> None:
    p = prompt(vocab=49152)
    engine = engine_for(big, tokenizer, max_total_tokens=2048)
    at_once = tokens_of(run_one(engine, TokenizedRequest("at_once", p, constrained(regex=PATTERN))))
    end, never = unused(big_free + at_once, 2, 49152)
    assert not re.fullmatch(r"[a-z]{1,3}", text(tokenizer, big_free[:1])), "the model's first choice is no answer"
    # its favourite first token is the start marker: it thinks (the grammar's mask had the start bit added)
    thinks = tokens_of(run_one(engine, TokenizedRequest("thinks", p, constrained(regex=PATTERN),
                                                        reasoning=plan([big_free[0]], [end], budget=2))))
    assert thinks[:4] == big_free[:3] + [end]
    assert re.fullmatch(PATTERN, text(tokenizer, thinks[4:]))
    # a start marker it does not pick: its first token is the grammar's, and so is all the rest
    answers = tokens_of(run_one(engine, TokenizedRequest("answers", p, constrained(regex=PATTERN),
                                                         reasoning=plan([never], [end], budget=2))))
    assert answers == at_once


def test_sampled_constrained_requests_answer_under_the_grammar(big: Any, tokenizer: Any, big_free: list[int]) -> None:
    end = unused(big_free, 1, 49152)
    engine = engine_for(big, tokenizer, max_total_tokens=2048)
    reqs = [TokenizedRequest(f"s{seed}", prompt(seed, 49152), SamplingParams(
        max_new_tokens=40, temperature=1.0, seed=seed, stop_token_ids=[EOS], regex=PATTERN),
        reasoning=plan([5], end, open=True, budget=4)) for seed in range(3)]
    out = run_to_completion(engine, reqs)
    for req in reqs:
        tokens = tokens_of(out[req.rid])
        assert tokens[4] == end[0] and re.fullmatch(PATTERN, text(tokenizer, tokens[5:])), tokens


def test_several_token_markers_around_a_constrained_answer(big: Any, tokenizer: Any, big_free: list[int]) -> None:
    p = prompt(vocab=49152)
    engine = engine_for(big, tokenizer, max_total_tokens=2048)
    second, end1, end2 = unused(big_free, 3, 49152)
    out = tokens_of(run_one(engine, TokenizedRequest("r", p, constrained(regex=PATTERN),
                                                     reasoning=plan([big_free[0], second], [end1, end2], budget=2))))
    assert out[:2] == [big_free[0], second]
    thinking = hf_greedy(big, p + out[:2], 2, None)
    assert_greedy_matches(big, p + out[:2], thinking, out[2:4])
    assert out[4:6] == [end1, end2]
    assert re.fullmatch(PATTERN, text(tokenizer, out[6:]))
