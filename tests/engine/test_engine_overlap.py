"""The overlap loop (plan and launch step N+1 before applying step N's tokens) changes when rows come out,
never what they are: the same tokens, logprobs and finishes as the plain loop, on the CPU where it is tested.
Under steady arrivals nearly every step overlaps: admission does not drain, only retraction does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ringserve.bus.messages import TokenizedRequest, FinishReason, SamplingParams, TokenRow
from tests.engine_helpers import (
    engine_for,
    greedy,
    run_to_completion,
    tokens_of,
)

EOS = 2
PROMPTS = [[5, 9, 2, 7, 11, 3], [4, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [7]]



def run(hf: Any, overlap: str, params: list[SamplingParams], **config: Any) -> dict[str, list[TokenRow]]:
    # One fixed thread (no thread tuner): the two loops' float rounding must not depend on timing.
    engine = engine_for(hf, overlap_schedule=overlap, torch_threads=1, **config)
    assert engine.overlap == (overlap == "on")
    rows = run_to_completion(engine, [TokenizedRequest(f"r{i}", p, q) for i, (p, q) in enumerate(zip(PROMPTS, params))])
    assert not engine.live and engine.stats().kv_running_tokens == 0
    assert (engine.counters.overlapped_steps > 0) == (overlap == "on"), "the overlap loop planned some steps ahead"
    return rows


def summary(rows: dict[str, list[TokenRow]]) -> dict[str, Any]:
    return {rid: (tokens_of(r), [x.completion_tokens for x in r], r[-1].finish, [x.logprobs for x in r])
            for rid, r in rows.items()}


@pytest.mark.parametrize("params", [
    [greedy(12), greedy(5), greedy(9), greedy(1)],  # different lengths: requests leave while others decode
    [greedy(16, stop_token_ids=[EOS]) for _ in PROMPTS],
    [SamplingParams(10, temperature=0.9, top_p=0.9, seed=s, return_logprob=True, top_logprobs_num=3)
     for s in range(4)],
    [SamplingParams(8, temperature=1.0, seed=7, frequency_penalty=0.5, presence_penalty=0.3,
                      repetition_penalty=1.2, min_new_tokens=3, stop_token_ids=[EOS]) for _ in PROMPTS],
])
def test_overlap_gives_the_plain_loops_rows(hf: Any, params: list[SamplingParams]) -> None:
    plain = summary(run(hf, "off", params))
    assert summary(run(hf, "on", params)) == plain
    for tokens, counts, finish, _ in plain.values():
        assert counts == list(range(1, len(tokens) + 1)) and finish is not None


def test_overlap_under_a_small_pool_and_chunked_prefill(hf: Any) -> None:
    params = [greedy(20) for _ in PROMPTS]
    config = dict(max_total_tokens=40, chunked_prefill_size=4, max_prefill_tokens=6)
    assert summary(run(hf, "on", params, **config)) == summary(run(hf, "off", params, **config))


def test_abort_while_a_step_is_in_flight(hf: Any) -> None:
    engine = engine_for(hf, overlap_schedule="on")
    for i, prompt in enumerate(PROMPTS[:3]):
        assert engine.add_request(TokenizedRequest(f"r{i}", prompt, greedy(30))) is None
    rows: dict[str, list[TokenRow]] = {}
    for _ in range(6):
        for row in engine.step():
            rows.setdefault(row.rid, []).append(row)
    assert engine._inflight is not None and engine.counters.overlapped_steps > 0, "an overlapped step is in flight"
    final = engine.abort("r1")
    assert final is not None and final.finish == FinishReason("abort")
    assert final.completion_tokens == len(tokens_of(rows["r1"]))  # the in-flight token is not counted
    engine.check_integrity()
    while engine.has_work():
        for row in engine.step():
            assert row.rid != "r1", "no row after the abort"
            rows.setdefault(row.rid, []).append(row)
        engine.check_integrity()
    expected = run(hf, "off", [greedy(30)] * 3)
    for rid in ("r0", "r2"):
        assert tokens_of(rows[rid]) == tokens_of(expected[rid])
    assert engine.stats().kv_running_tokens == 0


def arrivals(hf: Any, overlap: str, **config: Any) -> tuple[dict[str, list[TokenRow]], Any]:
    """A request arrives at two of every three steps while others run (the same calls of `step` in both
    loops); a third of them stop on any of 1/8 of the vocabulary, so stops land while a step is in flight."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 14, (16,), generator=gen)]
    params = [SamplingParams(6 + i % 9, temperature=0.8 if i % 2 else 0.0, top_k=40, seed=i, min_new_tokens=i % 4,
                             stop_token_ids=list(range(3, 512, 8)) if i % 3 == 1 else [EOS],
                             frequency_penalty=0.4 if i % 3 == 0 else 0.0,
                             return_logprob=i % 4 == 1, top_logprobs_num=2) for i in range(len(prompts))]
    engine = engine_for(hf, overlap_schedule=overlap, torch_threads=1, **config)
    rows: dict[str, list[TokenRow]] = {}
    pending = list(enumerate(zip(prompts, params)))
    step = 0
    while pending or engine.has_work():
        if pending and step % 3 != 2:  # two arrivals in every three steps
            i, (prompt, p) = pending.pop(0)
            assert engine.add_request(TokenizedRequest(f"r{i}", prompt, p)) is None
        for row in engine.step():
            rows.setdefault(row.rid, []).append(row)
        engine.check_integrity()
        step += 1
    assert not engine.live and engine.stats().kv_running_tokens == 0
    return rows, engine


def test_steady_arrivals_overlap_and_give_the_plain_loops_rows(hf: Any) -> None:
    config = dict(chunked_prefill_size=8, max_prefill_tokens=8)
    plain, _ = arrivals(hf, "off", **config)
    got, engine = arrivals(hf, "on", **config)
    assert summary(got) == summary(plain)
    assert engine.counters.drained_steps == 0, "a roomy pool never drains"
    # Every step overlaps but the first (nothing in flight yet) and the last (it only applies the step before).
    assert engine.counters.overlapped_steps == engine.counters.steps - 2 > 30


def test_steady_arrivals_under_a_short_pool_drain_only_to_retract(hf: Any) -> None:
    config = dict(max_total_tokens=48, chunked_prefill_size=8, max_prefill_tokens=8)
    plain, _ = arrivals(hf, "off", **config)
    got, engine = arrivals(hf, "on", **config)
    # Retractions fall on other steps in the two loops, and a recomputed prefill's KV may differ in the last
    # bits from the decoded one: the same tokens, logprobs equal to float32 rounding.
    a, b = summary(got), summary(plain)
    assert {rid: v[:3] for rid, v in a.items()} == {rid: v[:3] for rid, v in b.items()}
    for rid, (*_, logprobs) in a.items():
        flat = [v for x in logprobs if x for v in x]
        assert flat == pytest.approx([v for x in b[rid][3] if x for v in x], abs=1e-4)
    assert engine.counters.drained_steps > 0 and engine.counters.num_retractions > 0
    assert engine.counters.overlapped_steps > engine.counters.drained_steps
