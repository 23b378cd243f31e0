"""Request intake and finishing: validation errors, stop token ids, max_new_tokens, and seeded sampling."""

from __future__ import annotations

from typing import Any


from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.bus.messages import FinishReason, SamplingParams, TokenizedRequest
from tests.engine_helpers import (
    engine_for,
    greedy,
    run_to_completion,
    tokens_of,
)

PROMPT = [5, 17, 42, 99, 7]



def run_one(engine: EngineCore, sampling: SamplingParams, prompt: list[int] = PROMPT) -> tuple[list[int], FinishReason]:
    rows = run_to_completion(engine, [TokenizedRequest("one", prompt, sampling)])["one"]
    assert rows[-1].finish is not None
    return tokens_of(rows), rows[-1].finish


def test_invalid_requests_are_rejected_with_the_numbers(hf: Any) -> None:
    engine = engine_for(hf, max_total_tokens=64)  # context length is 256
    assert engine.add_request(TokenizedRequest("a", PROMPT, greedy(4))) is None

    duplicate = engine.add_request(TokenizedRequest("a", PROMPT, greedy(4)))
    assert duplicate is not None and duplicate.code == 400 and "'a'" in duplicate.message
    empty = engine.add_request(TokenizedRequest("b", [], greedy(4)))
    assert empty is not None and empty.code == 400 and empty.param == "input_ids"
    out_of_vocab = engine.add_request(TokenizedRequest("c", [1, 512], greedy(4)))
    assert out_of_vocab is not None and "512" in out_of_vocab.message
    negative = engine.add_request(TokenizedRequest("c", [-1], greedy(4)))
    assert negative is not None and negative.code == 400
    too_long_for_pool = engine.add_request(TokenizedRequest("d", PROMPT, greedy(60)))
    assert too_long_for_pool is not None and too_long_for_pool.code == 400
    assert "65" in too_long_for_pool.message and "KV pool (64" in too_long_for_pool.message
    big = engine_for(hf)
    too_long_for_context = big.add_request(TokenizedRequest("e", PROMPT, greedy(252)))
    assert too_long_for_context is not None and "context length (256" in too_long_for_context.message
    assert big.add_request(TokenizedRequest("e", PROMPT, greedy(251))) is None
    no_tokenizer = engine.add_request(TokenizedRequest("f", PROMPT, greedy(4, stop=["x"])))
    assert no_tokenizer is not None and no_tokenizer.code == 500
    assert engine.add_request(TokenizedRequest("g", PROMPT, greedy(-1))) is not None

    stats = engine.stats()
    assert (stats.num_waiting_reqs, stats.kv_running_tokens, stats.kv_total_tokens, stats.context_length) == (
        1, 0, 64, 256)


def test_stop_token_and_length_finish_reasons(hf: Any) -> None:
    engine = engine_for(hf)
    free_run, finish = run_one(engine, greedy(10))
    assert len(free_run) == 10 and finish == FinishReason("length")

    stop_at = free_run[3]
    first = free_run.index(stop_at)
    stopped, finish = run_one(engine, greedy(10, stop_token_ids=[stop_at]))
    assert stopped == free_run[: first + 1]  # the stop token is kept and counted
    assert finish == FinishReason("stop", matched=stop_at)
    assert engine.stats().kv_running_tokens == 0


def test_sampling_top_k_one_and_tiny_top_p_are_greedy_and_seeds_reproduce(hf: Any) -> None:
    engine = engine_for(hf)
    greedy_tokens, _ = run_one(engine, greedy(10))
    assert run_one(engine, SamplingParams(10, temperature=1.0, top_k=1))[0] == greedy_tokens
    assert run_one(engine, SamplingParams(10, temperature=1.0, top_p=1e-6))[0] == greedy_tokens

    seeded = SamplingParams(10, temperature=1.0, seed=1234)
    first, _ = run_one(engine, seeded)
    assert run_one(engine, seeded)[0] == first
    assert run_one(engine, SamplingParams(10, temperature=1.0, seed=4321))[0] != first
    # The seed fixes the draws whatever else shares the batch.
    together = run_to_completion(engine, [
        TokenizedRequest("x", [9, 8, 7], SamplingParams(10, temperature=1.0)),
        TokenizedRequest("y", PROMPT, seeded),
    ])
    assert tokens_of(together["y"]) == first


def test_a_failing_forward_or_stop_check_ends_only_its_requests(hf: Any) -> None:
    engine = engine_for(hf)
    assert engine.add_request(TokenizedRequest("a", PROMPT, greedy(5))) is None
    assert engine.add_request(TokenizedRequest("b", [9, 8, 7], greedy(5))) is None
    real_forward = engine.runner.forward

    def broken(batch: Any, mask: Any = None) -> Any:
        raise RuntimeError("device fell over")

    engine.runner.forward = broken  # type: ignore[method-assign]
    rows = engine.step()
    assert {r.rid for r in rows} == {"a", "b"}
    assert all(r.finish is not None and r.finish.type == "error" and "device fell over" in r.finish.error.message
               for r in rows)
    engine.check_integrity()
    assert engine.stats().kv_used_tokens == 0, "KV computed by a failed forward is not cached"
    engine.runner.forward = real_forward  # type: ignore[method-assign]

    real_check = engine.stop_checker.check

    def exploding_check(req: Any) -> Any:
        if req.rid == "bad":
            raise ValueError("cannot decode")
        return real_check(req)

    engine.stop_checker.check = exploding_check  # type: ignore[method-assign]
    rows = run_to_completion(engine, [TokenizedRequest("bad", PROMPT, greedy(5)), TokenizedRequest("good", PROMPT, greedy(5))])
    assert rows["bad"][-1].finish.type == "error" and len(rows["bad"]) == 1
    assert rows["good"][-1].finish == FinishReason("length") and len(tokens_of(rows["good"])) == 5
