"""No head-of-line blocking in prefill (issue 36): while long prompts prefill in chunks, a short prompt samples
its first token within k + 1 steps of its arrival (k: prompts queued ahead of it; k + 2 in the overlap loop),
running requests decode every step, and no step prefills more than the budget, the chunked prompts together
at most one chunk (the bound in actors/engine/scheduling/prefill.py). Steps are counted, not timed: the tiny model's
steps plan exactly as SmolLM2's do (planning reads only token counts)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ringserve.actors.engine.scheduling.prefill import MAX_CHUNKED
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import engine_for, greedy, tiny_hf_llama

CHUNK = 32


@pytest.fixture(scope="module")
def hf8k() -> Any:
    return tiny_hf_llama(max_position_embeddings=8192)


def _req(rid: str, n: int, gen: torch.Generator, new_tokens: int = 3) -> TokenizedRequest:
    return TokenizedRequest(rid, torch.randint(3, 512, (n,), generator=gen).tolist(), greedy(new_tokens))


def _run(hf: Any, first: list[TokenizedRequest], later: list[TokenizedRequest], overlap: str = "off",
         at: int = 2) -> tuple[dict[str, int], list[Any]]:
    """Submit `first`, step, submit `later` before step `at`; (rid -> steps from arrival to first token,
    every step's plan). Stops once "short" has its first token (the long prompts are aborted)."""
    engine = engine_for(hf, chunked_prefill_size=CHUNK, max_prefill_tokens=CHUNK, overlap_schedule=overlap)
    for req in first:
        assert engine.add_request(req) is None
    waited: dict[str, int] = {}
    arrived: dict[str, int] = {r.rid: 0 for r in first}
    plans: list[Any] = []
    step = 0
    while engine.has_work() and "short" not in waited:
        if step == at:
            for req in later:
                assert engine.add_request(req) is None
                arrived[req.rid] = step
        rows = engine.step()
        engine.check_integrity()
        step += 1
        if engine.last_plan() is not None:
            plans.append(engine.last_plan())
        for row in rows:
            waited.setdefault(row.rid, step - arrived[row.rid])
    engine.abort_all()
    engine.check_integrity()
    return waited, plans


def _assert_step_budget(plans: list[Any], chunked: set[str]) -> None:
    for plan in plans:
        assert sum(n for _, _, n in plan.prefill) <= CHUNK
        assert sum(n for rid, _, n in plan.prefill if rid in chunked) <= CHUNK


@pytest.mark.parametrize("overlap, extra", [("off", 0), ("on", 1)])
def test_a_short_prompt_beside_a_long_one_waits_one_step(hf8k: Any, overlap: str, extra: int) -> None:
    gen = torch.Generator().manual_seed(1)
    waited, plans = _run(hf8k, [_req("long", 4000, gen)], [_req("short", 4, gen)], overlap)
    assert waited["short"] <= 1 + extra, waited
    _assert_step_budget(plans, {"long"})


@pytest.mark.parametrize("ahead", [("medium", 48), ("long2", 3000)])
def test_a_prompt_that_does_not_fit_whole_is_chunked_and_does_not_block_the_queue(
        hf8k: Any, ahead: tuple[str, int]) -> None:
    """The measured cause of the issue's 157 s wait: a prompt that did not fit whole beside the chunked one
    waited for it to finish, and so did the 4-token prompt behind it (31 steps of a 1,000-token prompt's 32)."""
    gen = torch.Generator().manual_seed(2)
    rid, n = ahead
    waited, plans = _run(hf8k, [_req("long", 4000, gen)], [_req(rid, n, gen), _req("short", 4, gen)])
    assert waited["short"] <= 2, waited  # one prompt ahead of it: k + 1
    if rid == "medium":  # chunked beside the long one, not after it
        assert plans[-1].prefill[1][0] == "medium" and plans[-1].prefill[1][1] > 0
    _assert_step_budget(plans, {"long", rid})


def test_beyond_max_chunked_long_prompts_are_passed_over(hf8k: Any) -> None:
    gen = torch.Generator().manual_seed(3)
    longs = [_req(f"long{i}", 1500, gen) for i in range(MAX_CHUNKED + 2)]
    waited, plans = _run(hf8k, [_req("long", 3000, gen)], [*longs, _req("short", 4, gen)])
    # MAX_CHUNKED - 1 of the queued long prompts start their chunks (one per step), the rest are passed over
    assert waited["short"] <= MAX_CHUNKED + 1, waited
    chunked = {p for plan in plans for p, _, _ in plan.prefill if p.startswith("long")}
    assert len(chunked) == MAX_CHUNKED
    _assert_step_budget(plans, chunked)


def test_running_requests_decode_every_step_beside_the_chunks(hf8k: Any) -> None:
    gen = torch.Generator().manual_seed(4)
    engine = engine_for(hf8k, chunked_prefill_size=CHUNK, max_prefill_tokens=CHUNK)
    assert engine.add_request(_req("stream", 4, gen, new_tokens=40)) is None
    engine.step()  # the stream is running
    for req in (_req("long", 2000, gen), _req("medium", 100, gen)):
        assert engine.add_request(req) is None
    for _ in range(30):
        engine.step()
        plan = engine.last_plan()
        assert plan is not None and "stream" in plan.decode_rids
        assert sum(n for _, _, n in plan.prefill) <= CHUNK
    engine.abort_all()
    engine.check_integrity()
