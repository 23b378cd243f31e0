"""The overlap loop (plan and launch step N+1 before applying step N's tokens) changes when rows come out,
never what they are: the same tokens, logprobs and finishes as the plain loop, on the CPU where it is tested."""

from __future__ import annotations

from typing import Any

import pytest

from bus.messages import TokenizedRequest, FinishReason, SamplingParams, TokenRow
from tests.engine_helpers import (
    engine_for,
    greedy,
    run_to_completion,
    tiny_hf_llama,
    tokens_of,
    torch_single_thread,  # noqa: F401  (autouse fixture)
)

EOS = 2
PROMPTS = [[5, 9, 2, 7, 11, 3], [4, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [7]]


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_hf_llama()


def run(hf: Any, overlap: str, params: list[SamplingParams], **config: Any) -> dict[str, list[TokenRow]]:
    engine = engine_for(hf, overlap_schedule=overlap, **config)
    assert engine.overlap == (overlap == "on")
    planned = engine._schedule_after
    overlapped = []

    def counting(prev: Any) -> Any:
        batch = planned(prev)
        overlapped.append(batch is not None)
        return batch

    engine._schedule_after = counting  # type: ignore[method-assign]
    rows = run_to_completion(engine, [TokenizedRequest(f"r{i}", p, q) for i, (p, q) in enumerate(zip(PROMPTS, params))])
    assert not engine.live and engine.stats().kv_running_tokens == 0
    assert any(overlapped) == (overlap == "on"), "the overlap loop planned some steps ahead"
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
    assert engine._inflight is not None and engine._inflight[0].feed is not None, "an overlapped step is in flight"
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
