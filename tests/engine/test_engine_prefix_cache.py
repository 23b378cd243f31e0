"""The radix prefix cache inside the engine: shared prefixes are computed once, greedy output is unchanged,
cached tokens are reported, the lpm policy prefers cached prefixes, and a flush gives the slots back."""

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
MAX_NEW = 8


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    hf = tiny_hf_llama()
    gen = torch.Generator().manual_seed(11)
    system = torch.randint(3, 512, (40,), generator=gen).tolist()
    prompts = [system + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 7, 1, 12)]
    prompts.append(list(prompts[0]))  # an exact repeat
    return {"hf": hf, "system": system, "prompts": prompts,
            "expected": [hf_greedy(hf, p, MAX_NEW, EOS) for p in prompts]}


def request(rid: str, prompt: list[int]) -> TokenizedRequest:
    return TokenizedRequest(rid, prompt, greedy(MAX_NEW, stop_token_ids=[EOS]))


@pytest.mark.parametrize("radix", [True, False])
def test_greedy_output_is_the_same_with_and_without_the_cache(reference: dict[str, Any], radix: bool) -> None:
    engine = engine_for(reference["hf"], disable_radix_cache=not radix)
    cached = []
    for i, prompt in enumerate(reference["prompts"]):  # one at a time, so later ones can hit the cache
        rows = run_to_completion(engine, [request(f"r{i}", prompt)])[f"r{i}"]
        assert_greedy_matches(reference["hf"], prompt, reference["expected"][i], tokens_of(rows))
        cached.append(rows[0].cached_tokens)
        assert all(r.cached_tokens == cached[-1] for r in rows)
    stats = engine.stats()
    assert stats.kv_running_tokens == 0
    if radix:
        assert cached[0] == 0 and all(c >= len(reference["system"]) for c in cached[1:4])
        # the exact repeat finds everything but its last token (which must be computed to sample)
        assert cached[4] == len(reference["prompts"][4]) - 1
        assert stats.kv_cached_tokens > 0 and 0 < stats.cache_hit_rate < 1
    else:
        assert cached == [0] * 5 and stats.kv_cached_tokens == 0 and stats.kv_used_tokens == 0


def test_running_requests_share_a_prefix_prefilled_earlier(reference: dict[str, Any]) -> None:
    engine = engine_for(reference["hf"])
    prompts = reference["prompts"]
    assert engine.add_request(request("first", prompts[0])) is None
    engine.step()  # prefill: the prompt enters the cache while the request keeps running
    engine.check_integrity()
    assert engine.stats().kv_cached_tokens == 0, "a running request's prefix is protected, not evictable"
    rows = run_to_completion(engine, [request("second", prompts[1])])
    assert rows["second"][0].cached_tokens >= len(reference["system"])
    assert_greedy_matches(reference["hf"], prompts[1], reference["expected"][1], tokens_of(rows["second"]))
    while engine.has_work():
        engine.step()
    assert engine.stats().kv_running_tokens == 0


def test_flush_frees_every_unused_cached_slot(reference: dict[str, Any]) -> None:
    engine = engine_for(reference["hf"])
    run_to_completion(engine, [request("a", reference["prompts"][0])])
    held = engine.stats().kv_cached_tokens
    assert held > 0
    assert engine.flush_cache() == held
    stats = engine.stats()
    assert stats.kv_used_tokens == 0 and stats.kv_cached_tokens == 0
    engine.check_integrity()
    rows = run_to_completion(engine, [request("b", reference["prompts"][0])])["b"]
    assert rows[0].cached_tokens == 0


def test_lpm_admits_the_longest_cached_prefix_first(reference: dict[str, Any]) -> None:
    prompts = reference["prompts"]
    gen = torch.Generator().manual_seed(5)
    stranger = torch.randint(3, 512, (20,), generator=gen).tolist()
    order = {}
    for policy in ("fcfs", "lpm"):
        engine = engine_for(reference["hf"], schedule_policy=policy, max_running_requests=1)
        run_to_completion(engine, [request("warm", prompts[0])])
        for rid, prompt in (("stranger", stranger), ("sharer", prompts[2])):
            assert engine.add_request(request(rid, prompt)) is None
        order[policy] = [row.rid for row in engine.step()]
        while engine.has_work():
            engine.step()
    assert order == {"fcfs": ["stranger"], "lpm": ["sharer"]}
