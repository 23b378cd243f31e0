"""Prompt logprobs (`logprob_start_len`) and prompt-only scoring (`max_new_tokens` 0) in the engine, against
transformers' logits for the same prompt: whole and chunked prefill, a warm prefix cache, the overlap loop,
and a neighbour in the same batch that asked for nothing."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import engine_for, greedy, run_to_completion, tokens_of

TOP = 3


def prompt() -> list[int]:
    return torch.randint(3, 512, (23,), generator=torch.Generator().manual_seed(11)).tolist()


@torch.no_grad()
def reference(hf: Any, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' logprob and rank of every prompt token after the first, and the top TOP ids before it."""
    raw = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)  # [L-1, V]
    targets = torch.tensor(ids[1:])
    chosen = raw.gather(1, targets[:, None]).squeeze(1)
    ranks = (raw > chosen[:, None]).sum(-1) + 1
    return chosen, ranks, raw.topk(TOP, dim=-1).indices


def scoring(rid: str, start: int, max_new: int = 0) -> TokenizedRequest:
    return TokenizedRequest(rid, prompt(), greedy(max_new, return_logprob=True, top_logprobs_num=TOP,
                                                  logprob_start_len=start))


def check_scores(hf: Any, row: Any, start: int) -> None:
    chosen, ranks, top = reference(hf, prompt())
    assert row.prompt_ids == prompt() and len(row.prompt_logprobs) == len(prompt()) - start
    first = 0 if start else 1
    if start == 0:
        assert row.prompt_logprobs[0] is None and row.prompt_ranks[0] == 0 and row.prompt_top_ids[0] == []
    got = torch.tensor(row.prompt_logprobs[first:])
    torch.testing.assert_close(got, chosen[max(start, 1) - 1:], atol=1e-4, rtol=1e-4)
    assert row.prompt_ranks[first:] == ranks[max(start, 1) - 1:].tolist()
    assert [t[:1] for t in row.prompt_top_ids[first:]] == top[max(start, 1) - 1:, :1].tolist()
    assert all(len(t) == TOP for t in row.prompt_top_logprobs[first:])


@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_prompt_only_scoring_matches_transformers(hf: Any, chunk: int, overlap: str) -> None:
    engine = engine_for(hf, max_total_tokens=256, chunked_prefill_size=chunk, overlap_schedule=overlap)
    rows = run_to_completion(engine, [scoring("s", 0)])["s"]
    assert len(rows) == 1 and rows[0].token_ids == [] and rows[0].finish.type == "length"
    assert rows[0].completion_tokens == 0 and rows[0].prompt_tokens == len(prompt())
    check_scores(hf, rows[0], 0)
    assert engine.stats().kv_running_tokens == 0


def test_a_warm_prefix_cache_does_not_skip_the_positions_to_score(hf: Any) -> None:
    engine = engine_for(hf, max_total_tokens=256)
    run_to_completion(engine, [TokenizedRequest("warm", prompt(), greedy(2))])
    rows = run_to_completion(engine, [scoring("s", 9, max_new=3)])["s"]
    assert rows[0].cached_tokens == 8, "the prefix up to the first scored position's logits comes from the cache"
    check_scores(hf, rows[0], 9)
    assert not rows[1].prompt_ids, "only the first row carries the prompt's scores"
    assert len(tokens_of(rows)) == 3


def test_generation_beside_scoring_is_unchanged(hf: Any) -> None:
    other = TokenizedRequest("g", prompt()[:9], greedy(6))
    alone = tokens_of(run_to_completion(engine_for(hf, max_total_tokens=256), [other])["g"])
    engine = engine_for(hf, max_total_tokens=256, chunked_prefill_size=8)
    out = run_to_completion(engine, [scoring("s", 0, max_new=4), other])
    assert tokens_of(out["g"]) == alone and not out["g"][0].prompt_ids
    check_scores(hf, out["s"][0], 0)
    assert len(tokens_of(out["s"])) == 4


def test_a_start_past_the_prompt_is_refused(hf: Any) -> None:
    engine = engine_for(hf, max_total_tokens=256)
    error = engine.add_request(scoring("s", len(prompt())))
    assert error is not None and error.param == "logprob_start_len"
