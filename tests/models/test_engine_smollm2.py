"""The real SmolLM2-135M-Instruct through `EngineCore.from_source`: greedy tokens equal transformers' `generate`.

The model is loaded once (through transformers, as the engine does); the HF reference model is built from
the very same tensors, so any difference comes from the forward passes alone.
"""

from __future__ import annotations

from typing import Any

import pytest

from ringserve.actors.common.model_source import resolve_model
from ringserve.actors.engine.scheduling.engine_core import EngineCore, EngineConfig
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import (
    assert_greedy_matches,
    greedy,
    hf_greedy,
    run_to_completion,
    tokens_of,
)

PROMPTS = [
    "用一句话介绍你自己 😀",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colors.",
]
MAX_NEW = 20


@pytest.fixture(scope="module")
def smollm(smollm_hf: Any) -> dict[str, Any]:
    source = resolve_model("SmolLM2-135M-Instruct")
    engine = EngineCore.from_source(source, EngineConfig(device="cpu"))
    hf = smollm_hf  # transformers' own loading of the GGUF: checks our conversion too
    tokenizer = engine.tokenizer
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in PROMPTS
    ]
    eos = tokenizer.eos_token_id
    expected = [hf_greedy(hf, p, MAX_NEW, eos) for p in prompts]
    return {"engine": engine, "hf": hf, "prompts": prompts, "expected": expected, "eos": eos}


def request(smollm: dict[str, Any], rid: str, index: int) -> TokenizedRequest:
    return TokenizedRequest(rid, smollm["prompts"][index], greedy(MAX_NEW, stop_token_ids=[smollm["eos"]]))


def test_greedy_alone_matches_transformers(smollm: dict[str, Any]) -> None:
    engine: EngineCore = smollm["engine"]
    for i in range(3):
        rows = run_to_completion(engine, [request(smollm, f"alone{i}", i)])
        assert_greedy_matches(smollm["hf"], smollm["prompts"][i], smollm["expected"][i], tokens_of(rows[f"alone{i}"]))
    assert engine.stats().kv_running_tokens == 0


def test_greedy_eight_together_matches_transformers(smollm: dict[str, Any]) -> None:
    engine: EngineCore = smollm["engine"]
    n = len(PROMPTS)
    rows = run_to_completion(engine, [request(smollm, f"batch{i}", i % n) for i in range(8)])
    for i in range(8):
        got = tokens_of(rows[f"batch{i}"])
        assert_greedy_matches(smollm["hf"], smollm["prompts"][i % n], smollm["expected"][i % n], got)
    stats = engine.stats()
    assert (stats.kv_running_tokens, stats.num_running_reqs, stats.context_length) == (0, 0, 8192)
    # prompts 0-2 ran alone before (and 4-7 repeat 0-3): their prefixes came from the radix cache
    assert all(rows[f"batch{i}"][0].cached_tokens > 0 for i in range(3))


def test_greedy_with_small_chunks_and_no_cache_matches_transformers(smollm: dict[str, Any]) -> None:
    config = EngineConfig(device="cpu", chunked_prefill_size=8, disable_radix_cache=True, max_total_tokens=4096)
    engine = EngineCore(smollm["engine"].runner.model, config, smollm["engine"].tokenizer)
    rows = run_to_completion(engine, [request(smollm, f"chunk{i}", i) for i in range(len(PROMPTS))])
    for i in range(len(PROMPTS)):
        got = tokens_of(rows[f"chunk{i}"])
        assert_greedy_matches(smollm["hf"], smollm["prompts"][i], smollm["expected"][i], got)
        assert rows[f"chunk{i}"][0].cached_tokens == 0

