"""Chunked prefill: long prompts prefill in chunks between decode steps, with greedy output unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bus.messages import TokenizedRequest
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
