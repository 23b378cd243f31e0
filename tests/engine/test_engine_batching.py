"""Continuous batching on a tiny random Llama: greedy output equals transformers' alone, in shared and mixed
batches and under preemption, and every KV slot comes back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ringserve.bus.messages import FinishReason, TokenizedRequest
from tests.engine_helpers import (
    assert_greedy_matches,
    engine_for,
    greedy,
    hf_greedy,
    run_to_completion,
    tiny_hf_llama,
    tokens_of,
)

EOS = 2
MAX_NEW = 12
PROMPT_LENGTHS = (1, 5, 9, 17, 30)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    hf = tiny_hf_llama()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    return {"hf": hf, "prompts": prompts, "expected": [hf_greedy(hf, p, MAX_NEW, EOS) for p in prompts]}


def requests(prompts: list[list[int]]) -> list[TokenizedRequest]:
    return [TokenizedRequest(f"r{i}", p, greedy(MAX_NEW, stop_token_ids=[EOS])) for i, p in enumerate(prompts)]


def check_all(reference: dict[str, Any], outputs: dict[str, list[int]]) -> None:
    for i, (prompt, expected) in enumerate(zip(reference["prompts"], reference["expected"])):
        assert_greedy_matches(reference["hf"], prompt, expected, outputs[f"r{i}"])


def test_greedy_alone_matches_transformers(reference: dict[str, Any]) -> None:
    engine = engine_for(reference["hf"])
    outputs = {}
    for req in requests(reference["prompts"]):
        outputs[req.rid] = tokens_of(run_to_completion(engine, [req])[req.rid])
    check_all(reference, outputs)
    assert engine.stats().kv_running_tokens == 0


def test_greedy_together_matches_transformers(reference: dict[str, Any]) -> None:
    engine = engine_for(reference["hf"])
    rows = run_to_completion(engine, requests(reference["prompts"]))
    check_all(reference, {rid: tokens_of(r) for rid, r in rows.items()})
    for rid, req_rows in rows.items():
        assert req_rows[0].decode is not None and not any(r.decode is not None for r in req_rows[1:])
        assert [r.completion_tokens for r in req_rows] == list(range(1, len(req_rows) + 1))
        assert all(r.finish is None for r in req_rows[:-1]) and req_rows[-1].finish is not None
    stats = engine.stats()
    assert (stats.kv_running_tokens, stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0, 0)


def test_mixed_prefill_and_decode_steps(reference: dict[str, Any]) -> None:
    # Without chunking, a 20-token prefill budget admits whole prompts over several steps while earlier ones
    # decode.
    engine = engine_for(reference["hf"], max_prefill_tokens=20, chunked_prefill_size=0)
    for req in requests(reference["prompts"]):
        assert engine.add_request(req) is None
    outputs: dict[str, list[int]] = {}
    step_rids = []
    while engine.has_work():
        rows = engine.step()
        step_rids.append({row.rid for row in rows})
        for row in rows:
            outputs.setdefault(row.rid, []).extend(row.token_ids)
    check_all(reference, outputs)
    assert step_rids[0] == {"r0", "r1", "r2"}  # 1 + 5 + 9 fit the budget; 17 more would not
    assert step_rids[1] == {"r0", "r1", "r2", "r3"}  # r3's prefill runs alongside three decodes
    assert "r4" in step_rids[2]  # 30 tokens exceed the budget but are admitted as the step's only prefill
    assert engine.stats().kv_running_tokens == 0


def test_preemption_under_a_tiny_pool_keeps_greedy_output(reference: dict[str, Any]) -> None:
    engine = engine_for(reference["hf"], max_total_tokens=48)
    rows = run_to_completion(engine, requests(reference["prompts"]))
    check_all(reference, {rid: tokens_of(r) for rid, r in rows.items()})
    stats = engine.stats()
    assert stats.num_retractions > 0
    assert stats.kv_running_tokens == 0
    for req_rows in rows.values():  # a resumed request neither repeats nor skips output
        assert [r.completion_tokens for r in req_rows] == list(range(1, len(req_rows) + 1))


def test_abort_frees_kv_of_running_and_waiting_requests(reference: dict[str, Any]) -> None:
    engine = engine_for(reference["hf"], max_running_requests=2)
    for req in requests(reference["prompts"][:3]):
        assert engine.add_request(req) is None
    first = engine.step()
    assert {row.rid for row in first} == {"r0", "r1"}
    assert engine.stats().kv_running_tokens > 0

    running = engine.abort("r1")
    assert running is not None and running.finish == FinishReason("abort")
    assert (running.token_ids, running.completion_tokens, running.decode is not None) == ([], 1, False)
    waiting = engine.abort("r2")
    assert waiting is not None and waiting.finish == FinishReason("abort")
    assert waiting.decode is not None  # r2 never produced a row, so this is its first
    assert engine.abort("r2") is None and engine.abort("nope") is None

    stats = engine.stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_running_tokens) == (1, 0, 1)
    assert engine.abort("r0") is not None
    assert engine.stats().kv_running_tokens == 0 and not engine.has_work()
    assert engine.add_request(requests(reference["prompts"][:1])[0]) is None, "an aborted rid may be reused"


def test_queue_time_is_reported_once_and_counts_the_wait_for_a_slot(reference: dict[str, Any]) -> None:
    engine = engine_for(reference["hf"], max_running_requests=1)
    rows = run_to_completion(engine, requests(reference["prompts"][:2]))
    for req_rows in rows.values():
        assert req_rows[0].decode is not None and req_rows[0].queue_time is not None and req_rows[0].queue_time >= 0
        assert all(row.queue_time is None for row in req_rows[1:])
    # r1 waited in the queue for all of r0's steps
    assert rows["r1"][0].queue_time > rows["r0"][0].queue_time
    aborted = engine_for(reference["hf"])
    assert aborted.add_request(requests(reference["prompts"][:1])[0]) is None
    final = aborted.abort("r0")
    assert final is not None and final.decode is not None and final.queue_time is None  # never admitted: no queue time
