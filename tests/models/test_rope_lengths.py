"""Length-dependent rotaries (`dynamic`, Phi-3's `longrope`) as transformers' `generate` runs them, through the
engine: a prompt past the original context is rotated for its whole length however it is chunked; Phi-3 encodes
a request's whole sequence again when decoding first passes the original context; the prefix cache keeps keys
rotated for different lengths apart; speculation never verifies across the switch (models/rope.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import assert_greedy_matches, engine_for, greedy, hf_greedy, run_to_completion, tokens_of
from tests.model_families import COMMON, ORIGINAL_CONTEXT, VOCAB, tiny_hf_from_config, tiny_hf_model

NEW_TOKENS = 10


def _dynamic_llama() -> Any:
    from transformers import LlamaConfig

    config = LlamaConfig(**{**COMMON, "max_position_embeddings": ORIGINAL_CONTEXT},
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    return tiny_hf_from_config(config)


@pytest.fixture(scope="module", params=["phi3", "dynamic"])
def hf(request: pytest.FixtureRequest) -> Any:
    return tiny_hf_model("phi3") if request.param == "phi3" else _dynamic_llama()


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()


def _check(engine: Any, hf: Any, prompts: dict[str, list[int]], new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    """Run `prompts` batched; each one's greedy tokens must be transformers'. Returns their rows."""
    rows = run_to_completion(engine, [TokenizedRequest(rid, p, greedy(new_tokens)) for rid, p in prompts.items()])
    for rid, prompt in prompts.items():
        # each reference from a fresh rotary: transformers' dynamic one keeps the longest length it has seen (a
        # shorter sequence past the original context would get stale frequencies)
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)
        assert_greedy_matches(hf, prompt, hf_greedy(hf, prompt, new_tokens, None), tokens_of(rows[rid]))
    return rows


@pytest.mark.parametrize("chunk", [0, 7])
def test_long_prompts_and_their_short_prefixes_give_transformers_tokens(hf: Any, chunk: int) -> None:
    """A prompt past the original context (chunks before and across it), then prompts sharing its first tokens:
    one within the original context (it must not reuse the long prompt's keys), one of the same length
    (Phi-3: the same long factors, a prefix-cache hit) and the long prompt again (a hit for both)."""
    engine = engine_for(hf, max_total_tokens=2048, chunked_prefill_size=chunk)
    long = _prompt(ORIGINAL_CONTEXT + 6, seed=1)
    _check(engine, hf, {"long": long})
    short = _check(engine, hf, {"short": long[:ORIGINAL_CONTEXT - 12]})["short"]
    assert short[0].cached_tokens == 0  # the long prompt's keys are rotated for its length: never a short one's
    again = _check(engine, hf, {"again": list(long)})["again"]
    assert again[0].cached_tokens == len(long) - 1
    sibling = _check(engine, hf, {"sibling": long[:ORIGINAL_CONTEXT + 2] + _prompt(4, seed=2)})["sibling"]
    assert sibling[0].cached_tokens == ORIGINAL_CONTEXT + 2  # the same length: rotated alike
    assert engine.stats().kv_running_tokens == 0


def test_decoding_past_the_original_context_encodes_the_sequence_again(hf: Any) -> None:
    """Prompts that cross the original context while decoding (Phi-3 then computes every key again with the long
    factors, as its `generate` drops its cache there), batched beside a long prompt; then a request that sends
    one of those whole sequences back (a second turn) is rotated as a long prompt."""
    engine = engine_for(hf, max_total_tokens=2048)
    prompts = {"a": _prompt(ORIGINAL_CONTEXT - 3, seed=3), "b": _prompt(ORIGINAL_CONTEXT - 1, seed=4),
               "c": _prompt(ORIGINAL_CONTEXT + 2, seed=5), "d": _prompt(5, seed=6)}
    rows = run_to_completion(engine, [TokenizedRequest(r, p, greedy(NEW_TOKENS)) for r, p in prompts.items()])
    for rid, prompt in prompts.items():
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)
        assert_greedy_matches(hf, prompt, hf_greedy(hf, prompt, NEW_TOKENS, None), tokens_of(rows[rid]))
    _check(engine, hf, {"turn2": prompts["a"] + tokens_of(rows["a"]) + _prompt(3, seed=7)})


def test_speculation_stops_short_of_the_switch_to_the_long_factors() -> None:
    """Phi-3 drafting for itself (drafts accepted) while decoding across the original context: no step computes a
    position past it for a request still rotated short (a verify row never spans the switch; the sequence is
    encoded again first), and the tokens are transformers' (whose `generate` encodes it again there)."""
    hf = tiny_hf_model("phi3")
    engine = engine_for(hf, max_total_tokens=2048, speculative_algorithm="draft",
                        speculative_draft_model_path="(in process)", draft=engine_for(hf, max_total_tokens=2048))
    prompt = _prompt(ORIGINAL_CONTEXT - 10, seed=8)  # verify rows of 4 from it would span the switch
    assert engine.add_request(TokenizedRequest("spec", prompt, greedy(24))) is None
    tokens: list[int] = []
    while engine.has_work():
        tokens += [t for row in engine.step() for t in row.token_ids]
        batch = engine._last_batch
        for req, start, n in zip(batch.reqs, batch.starts, batch.extend_lens):
            assert start + n <= ORIGINAL_CONTEXT or req.rope_floor > ORIGINAL_CONTEXT, (start, n, req.rope_floor)
    assert engine.stats().spec_accepted_tokens > 10
    assert_greedy_matches(hf, prompt, hf_greedy(hf, prompt, 24, None), tokens)
