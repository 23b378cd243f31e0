"""Chunked prefill: long prompts prefill in chunks between decode steps, with greedy output unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ringserve.bus.messages import TokenizedRequest
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


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    hf = tiny_hf_llama(max_position_embeddings=8192)
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (37, 5, 64, 23)]
    prompts.append(prompts[2][:50] + torch.randint(3, 512, (9,), generator=gen).tolist())  # shares 50 tokens
    return {"hf": hf, "prompts": prompts, "expected": [hf_greedy(hf, p, 10, EOS) for p in prompts]}


@pytest.mark.parametrize("chunk, radix", [(4, True), (7, False), (16, True)])
def test_chunked_prefill_keeps_greedy_output(reference: dict[str, Any], chunk: int, radix: bool) -> None:
    engine = engine_for(reference["hf"], chunked_prefill_size=chunk, max_prefill_tokens=chunk,
                        disable_radix_cache=not radix)
    requests = [TokenizedRequest(f"r{i}", p, greedy(10, stop_token_ids=[EOS])) for i, p in enumerate(reference["prompts"])]
    # the first three arrive together (admitted in chunks, mixed with decodes), the others later, so they may
    # find their prefix cached
    for req in requests[:3]:
        assert engine.add_request(req) is None
    rows: dict[str, list] = {}
    steps = 0
    while engine.has_work():
        batch = engine.schedule()
        assert batch is not None
        assert sum(n for n in batch.extend_lens[batch.num_decode :]) <= chunk  # the per-step prefill budget
        for row in engine.finish(batch, engine.launch(batch)):
            rows.setdefault(row.rid, []).append(row)
        engine.check_integrity()
        steps += 1
        if steps == 3:
            for req in requests[3:]:
                assert engine.add_request(req) is None
    for i, prompt in enumerate(reference["prompts"]):
        assert_greedy_matches(reference["hf"], prompt, reference["expected"][i], tokens_of(rows[f"r{i}"]))
    if radix:
        assert rows["r4"][0].cached_tokens >= 48
    assert engine.stats().kv_running_tokens == 0


def test_a_running_stream_gets_a_token_every_step_while_a_4k_prompt_prefills(reference: dict[str, Any]) -> None:
    chunk = 256
    engine = engine_for(reference["hf"], chunked_prefill_size=chunk)
    gen = torch.Generator().manual_seed(4)
    long_prompt = torch.randint(3, 512, (4096,), generator=gen).tolist()
    assert engine.add_request(TokenizedRequest("stream", [5, 6, 7], greedy(40))) is None
    engine.step()
    assert engine.add_request(TokenizedRequest("long", long_prompt, greedy(2))) is None
    steps_until_long = 0
    while True:
        batch = engine.schedule()
        assert batch is not None and batch.num_tokens <= chunk + 1  # one chunk plus the stream's decode token
        rows = engine.finish(batch, engine.launch(batch))
        assert "stream" in {r.rid for r in rows}, "the running stream must not wait for the long prefill"
        steps_until_long += 1
        if "long" in {r.rid for r in rows}:
            break
    assert steps_until_long == 4096 // chunk
    engine.abort("long")
    engine.abort("stream")
    engine.check_integrity()


def test_without_chunking_a_long_prompt_runs_whole(reference: dict[str, Any]) -> None:
    engine = engine_for(reference["hf"], chunked_prefill_size=0, max_prefill_tokens=16)
    prompt = reference["prompts"][2]  # 64 tokens, over the budget: admitted alone, in one step
    rows = run_to_completion(engine, [TokenizedRequest("whole", prompt, greedy(3))])["whole"]
    assert len(rows) == 3


def _solo(hf: Any, request: TokenizedRequest, **config: Any) -> list[int]:
    return tokens_of(run_to_completion(engine_for(hf, **config), [request])[request.rid])


@pytest.mark.parametrize("budget, overlap", [(16, "off"), (8192, "off"), (16, "on")])
def test_short_prompts_are_admitted_beside_a_long_prompts_chunks(reference: dict[str, Any], budget: int,
                                                                 overlap: str) -> None:
    """Head-of-line blocking: short prompts arriving while a long one is chunked sample their first token in
    the next step (the step after, in the overlap loop), not after the long prefill; the long one still gets
    at least half a chunk every step; greedy output equals each request's solo run."""
    chunk = 16
    config = dict(chunked_prefill_size=chunk, max_prefill_tokens=budget, overlap_schedule=overlap)
    hf = reference["hf"]
    gen = torch.Generator().manual_seed(8)
    long_req = TokenizedRequest("long", torch.randint(3, 512, (160,), generator=gen).tolist(), greedy(5))
    shorts = [TokenizedRequest(f"short{i}", torch.randint(3, 512, (n,), generator=gen).tolist(), greedy(6))
              for i, n in enumerate((6, 8, 3))]
    solo = {r.rid: _solo(hf, r, **config) for r in [long_req, *shorts]}
    engine = engine_for(hf, **config)
    within = 1 if overlap == "off" else 2  # the overlap loop returns a step's rows from the next step() call
    assert engine.add_request(long_req) is None
    rows: dict[str, list] = {}
    arrived: dict[str, int] = {}
    first_token: dict[str, int] = {}
    long_chunks: list[int] = []
    step = 0
    while engine.has_work():
        if 2 <= step < 2 + len(shorts):  # one short prompt arrives each step while the long one is chunked
            short = shorts[step - 2]
            assert engine.prefill.chunked is not None and engine.prefill.chunked.rid == "long"
            assert engine.add_request(short) is None
            arrived[short.rid] = step
        out = engine.step()
        engine.check_integrity()
        step += 1
        plan = engine.last_plan()
        if plan is not None:
            assert sum(n for _, _, n in plan.prefill) <= budget
            long_chunks += [n for rid, _, n in plan.prefill if rid == "long"]
        for row in out:
            rows.setdefault(row.rid, []).append(row)
            first_token.setdefault(row.rid, step)
    for short in shorts:
        assert first_token[short.rid] - arrived[short.rid] <= within, (short.rid, arrived, first_token)
        assert first_token[short.rid] < first_token["long"], "a short prompt waited for the long prefill"
    # the long prompt kept chunking meanwhile: at least half a chunk each step, never more than one chunk
    assert sum(long_chunks) == 160 and all(n <= chunk for n in long_chunks)
    assert all(n >= chunk // 2 for n in long_chunks[:-1]), long_chunks
    for req in [long_req, *shorts]:
        assert_greedy_matches(hf, req.input_ids, solo[req.rid], tokens_of(rows[req.rid]))
    assert engine.stats().kv_running_tokens == 0


def test_a_prompt_too_long_to_run_beside_the_chunked_one_is_chunked_too(reference: dict[str, Any]) -> None:
    """A waiting prompt that does not fit whole in the share left beside the chunked one is chunked too (it
    used to wait for the chunked one to finish, and so did the short prompt queued behind it): the short one
    is admitted within 2 steps (one prompt ahead of it), and the chunked requests together take at most a
    chunk per step."""
    chunk = 16
    engine = engine_for(reference["hf"], chunked_prefill_size=chunk, max_prefill_tokens=chunk)
    gen = torch.Generator().manual_seed(9)
    assert engine.add_request(TokenizedRequest("long", torch.randint(3, 512, (64,), generator=gen).tolist(),
                                               greedy(2))) is None
    engine.step()
    for rid, n in (("medium", 12), ("short", 4)):  # 12 > the 8 tokens left beside the chunked request
        assert engine.add_request(TokenizedRequest(rid, torch.randint(3, 512, (n,), generator=gen).tolist(),
                                                   greedy(2))) is None
    admitted: dict[str, int] = {}
    step = 0
    while engine.prefill.waiting or engine.prefill.chunked is not None:
        engine.step()
        engine.check_integrity()
        step += 1
        plan = engine.last_plan()
        assert plan is not None and sum(n for _, _, n in plan.prefill) <= chunk
        for rid, _, _ in plan.prefill:
            admitted.setdefault(rid, step)
    assert admitted["medium"] == 1 and admitted["short"] == 2, admitted
    engine.abort_all()
    engine.check_integrity()


def test_long_prompts_that_together_overfill_the_pool_all_finish(reference: dict[str, Any]) -> None:
    """Six 1,556-token prompts at once in a 4,096-slot pool, prefilled in 256-token chunks: a prompt becomes
    chunked only when all of it fits beside what the chunked prompts still have to compute, so chunked prompts
    never fill the pool between them with none able to go on (it deadlocked: every slot held by four
    half-prefilled prompts, nothing running to free one)."""
    hf = reference["hf"]
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (1556,), generator=gen).tolist() for _ in range(6)]
    engine = engine_for(hf, chunked_prefill_size=256, max_prefill_tokens=256, max_total_tokens=4096)
    for i, prompt in enumerate(prompts):
        assert engine.add_request(TokenizedRequest(f"r{i}", prompt, greedy(4, stop_token_ids=[EOS]))) is None
    rows: dict[str, list[Any]] = {}
    for _ in range(500):  # about 6 × 1556 / 256 prefill steps and the decodes: far fewer; a deadlock never ends
        if not engine.has_work():
            break
        for row in engine.step():
            rows.setdefault(row.rid, []).append(row)
        engine.check_integrity()
    assert not engine.has_work(), f"stuck: {engine.stats()}"
    for i, prompt in enumerate(prompts):
        assert_greedy_matches(hf, prompt, hf_greedy(hf, prompt, 4, EOS), tokens_of(rows[f"r{i}"]))
    assert engine.stats().kv_running_tokens == 0
