"""Sampling parameters through the engine: min_new_tokens, logprobs, penalties, logit_bias and seeds."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ringserve.bus.messages import TokenizedRequest, SamplingParams
from tests.engine_helpers import (
    engine_for,
    greedy,
    run_to_completion,
    tokens_of,
)

PROMPT = [5, 17, 42, 99, 7]



def run(hf: Any, params: SamplingParams, prompt: list[int] = PROMPT, **config: Any) -> list:
    return run_to_completion(engine_for(hf, **config), [TokenizedRequest("x", prompt, params)])["x"]


def test_min_new_tokens_holds_off_stop_tokens(hf: Any) -> None:
    free_run = tokens_of(run(hf, greedy(12)))
    stop = free_run[1]
    assert tokens_of(run(hf, greedy(12, stop_token_ids=[stop])))[-1] == stop
    rows = run(hf, greedy(12, stop_token_ids=[stop], min_new_tokens=6))
    tokens = tokens_of(rows)
    assert len(tokens) >= 6 and stop not in tokens[:6]


def test_logprobs_come_with_each_token(hf: Any) -> None:
    rows = run(hf, greedy(6, return_logprob=True, top_logprobs_num=3))
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)
    first = rows[0]
    assert first.top_ids[0][0] == first.token_ids[0] == int(logits.argmax())
    assert first.logprobs[0] == pytest.approx(float(expected[first.token_ids[0]]), abs=1e-4)
    assert first.top_logprobs[0] == pytest.approx(expected.topk(3).values.tolist(), abs=1e-4)
    for row in rows:
        assert len(row.logprobs) == len(row.top_ids) == len(row.top_logprobs) == 1 and len(row.top_ids[0]) == 3
    assert not run(hf, greedy(3))[0].logprobs


def test_penalties_and_logit_bias_change_the_output(hf: Any) -> None:
    plain = tokens_of(run(hf, greedy(16)))
    repeats = len(plain) - len(set(plain))
    penalised = tokens_of(run(hf, greedy(16, frequency_penalty=2.0, presence_penalty=2.0)))
    assert len(penalised) - len(set(penalised)) < repeats or repeats == 0
    assert penalised != plain
    assert tokens_of(run(hf, greedy(16, repetition_penalty=2.0))) != plain
    forced = tokens_of(run(hf, greedy(4, logit_bias={77: 100.0})))
    assert forced == [77] * 4


def test_seeded_draws_do_not_depend_on_the_batch(hf: Any) -> None:
    seeded = SamplingParams(10, temperature=1.0, seed=1234)
    alone = tokens_of(run(hf, seeded))
    engine = engine_for(hf)
    together = run_to_completion(engine, [
        TokenizedRequest("noise", [9, 8, 7], SamplingParams(10, temperature=1.0)),
        TokenizedRequest("x", PROMPT, seeded),
    ])
    assert tokens_of(together["x"]) == alone
    assert tokens_of(run(hf, SamplingParams(10, temperature=1.0, seed=4321))) != alone
