"""Steps stay short on a busy host (issue 53): the chunk a long prompt prefills per step is cut to what about a
second allows at the recent steps' cost (actors/engine/scheduling/step_pace.py), so a short request beside it
waits a few short steps. Step costs are given to the pace, never measured against a constant: what is asserted
is the plan the engine makes from them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ringserve.actors.engine.scheduling.step_pace import FLOOR_TOKENS, TARGET_STEP_SECONDS, StepPace
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import engine_for, greedy, tiny_hf_llama

CHUNK = 512


def test_the_chunk_is_what_the_target_allows_at_the_measured_cost() -> None:
    pace = StepPace()
    assert pace.chunk(CHUNK) == CHUNK  # nothing measured yet
    pace.record(CHUNK, 0.1 * TARGET_STEP_SECONDS)
    assert pace.chunk(CHUNK) == CHUNK  # a fast host keeps the configured chunk
    for _ in range(8):
        pace.record(CHUNK, 4 * TARGET_STEP_SECONDS)  # a busy host: a chunk takes four targets
    assert pace.chunk(CHUNK) == CHUNK // 4  # a power of two at or below what fits (just over 128 tokens)
    assert pace.chunk(CHUNK, shared=False) == CHUNK  # a prompt alone: four targets a step is within its bound
    for _ in range(8):
        pace.record(FLOOR_TOKENS, 10 * TARGET_STEP_SECONDS)
    assert pace.chunk(CHUNK) == FLOOR_TOKENS  # never below the floor
    assert pace.chunk(FLOOR_TOKENS // 2) == FLOOR_TOKENS // 2  # a configured chunk below it is kept
    pace.record(1, 100.0)  # a decode step says nothing about the cost per prompt token
    assert pace.cost == pytest.approx(10 * TARGET_STEP_SECONDS / FLOOR_TOKENS, rel=0.01)
    for _ in range(12):
        pace.record(CHUNK, 0.1 * TARGET_STEP_SECONDS)
    assert pace.chunk(CHUNK) == CHUNK  # the host is quiet again


@pytest.fixture(scope="module")
def hf8k() -> Any:
    return tiny_hf_llama(max_position_embeddings=8192)


def test_a_busy_host_cuts_the_chunks_and_a_short_prompt_beside_them_is_answered_first(hf8k: Any) -> None:
    gen = torch.Generator().manual_seed(5)
    engine = engine_for(hf8k, chunked_prefill_size=CHUNK, max_prefill_tokens=CHUNK)
    pace = engine.prefill.pace
    assert pace is not None
    engine.add_request(TokenizedRequest("long", torch.randint(3, 512, (4000,), generator=gen).tolist(), greedy(2)))
    plans = []
    for step in range(4):
        for _ in range(4):  # the host is busy: the steps so far took four targets per chunk
            pace.record(CHUNK, 8 * TARGET_STEP_SECONDS)
        expected = pace.chunk(CHUNK, shared=step > 0)
        if step == 1:
            engine.add_request(TokenizedRequest("short", [5, 9, 2, 7], greedy(3, ignore_eos=True)))
        rows = engine.step()
        plan = engine.last_plan()
        assert plan is not None
        plans.append(plan)
        long_tokens = sum(n for rid, _, n in plan.prefill if rid == "long")
        assert long_tokens <= expected < CHUNK, (step, plan)
        if step >= 1:  # the short prompt: prefilled in the step after it came, then decoding beside the chunks
            assert any(rid == "short" for rid, _, _ in plan.prefill) or "short" in plan.decode_rids, plan
        if step == 3:
            assert [r.rid for r in rows if r.finish is not None] == ["short"]  # 3 tokens in 3 steps
    engine.abort_all()
    engine.check_integrity()


def test_deterministic_inference_keeps_the_configured_chunk(hf8k: Any) -> None:
    """Where outputs must not depend on timing, chunk boundaries must not either."""
    assert engine_for(hf8k, chunked_prefill_size=CHUNK, enable_deterministic_inference=True).prefill.pace is None
