"""A randomized run of the engine under a small KV pool: arrivals, finishes, aborts, chunked prefill, cached
prefixes and retractions interleave; the pool's integrity holds after every step and every request that was
not aborted decodes exactly what transformers does, with its rows neither repeated nor skipped; with the
overlap loop too."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from ringserve.bus.messages import TokenizedRequest, TokenRow
from tests.engine_helpers import (
    assert_greedy_matches,
    engine_for,
    greedy,
    hf_greedy,
    tokens_of,
)

EOS = 2



@pytest.mark.parametrize("seed, radix, overlap", [(0, True, "off"), (1, True, "off"), (2, False, "off"),
                                                  (3, True, "on"), (4, False, "on")])
def test_random_traffic_keeps_the_pool_whole_and_the_output_exact(hf: Any, seed: int, radix: bool,
                                                                  overlap: str) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (12, 20, 30)]
    engine = engine_for(hf, max_total_tokens=72, max_running_requests=8, chunked_prefill_size=8,
                        max_prefill_tokens=12, disable_radix_cache=not radix, overlap_schedule=overlap)
    prompts: dict[str, list[int]] = {}
    rows: dict[str, list[TokenRow]] = {}
    aborted: set[str] = set()
    for step in range(400):
        if len(prompts) < 24 and rng.random() < 0.5:
            rid = f"q{len(prompts)}"
            prefix = rng.choice(prefixes)[: rng.randint(0, 30)]
            prompt = prefix + torch.randint(3, 512, (rng.randint(1, 10),), generator=gen).tolist()
            prompts[rid] = prompt
            assert engine.add_request(TokenizedRequest(rid, prompt, greedy(rng.randint(1, 24), stop_token_ids=[EOS]))) is None
        live = list(engine.live)
        if live and rng.random() < 0.05:
            rid = rng.choice(live)
            final = engine.abort(rid)
            assert final is not None and final.finish is not None and final.finish.type == "abort"
            rows.setdefault(rid, []).append(final)
            aborted.add(rid)
        for row in engine.step():
            rows.setdefault(row.rid, []).append(row)
        engine.check_integrity()
        stats = engine.stats()
        assert stats.kv_running_tokens + stats.kv_cached_tokens == stats.kv_used_tokens <= stats.kv_total_tokens
        if len(prompts) == 24 and not engine.has_work():
            break
    assert not engine.has_work(), "the engine must drain"
    assert engine.stats().kv_running_tokens == 0 and not engine.live
    assert engine.counters.num_retractions > 0, "the pool is small enough that retraction must happen"
    finished = [rid for rid in prompts if rid not in aborted]
    assert len(finished) >= 12
    for rid in finished:
        req_rows = rows[rid]
        assert req_rows[-1].finish is not None and all(r.finish is None for r in req_rows[:-1])
        assert [r.completion_tokens for r in req_rows] == list(range(1, len(req_rows) + 1))
        got = tokens_of(req_rows)
        expected = hf_greedy(hf, prompts[rid], len(got), EOS)
        assert_greedy_matches(hf, prompts[rid], expected, got)
    if radix:
        assert any(rows[rid][0].cached_tokens > 0 for rid in prompts)
