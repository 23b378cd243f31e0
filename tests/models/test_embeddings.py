"""Embedding requests through the engine: the pooled final-norm hidden states equal transformers' own
`model.model(...)` last_hidden_state (SmolLM2, and the Qwen3 and Gemma 3 families), batched and chunked as one
at a time, beside a generating request whose tokens are unchanged, and the same on a prefix-cache hit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from ringserve.bus.messages import TokenizedRequest, TokenRow
from ringserve.bus.params import EmbedParams
from tests.engine_helpers import engine_for, greedy, run_to_completion, tokens_of
from tests.model_families import VOCAB, tiny_hf_model


def embed_request(rid: str, ids: list[int], pooling: str | None = None, normalize: bool = True) -> TokenizedRequest:
    return TokenizedRequest(rid, ids, greedy(0), embed=EmbedParams(pooling, normalize))


def vector(rows: list[TokenRow]) -> np.ndarray:
    assert len(rows) == 1 and rows[0].finish is not None and rows[0].finish.type == "length"
    return np.frombuffer(rows[0].embedding, dtype="<f4")


@torch.no_grad()
def reference(hf: Any, ids: list[int], pooling: str, normalize: bool = True) -> np.ndarray:
    """transformers' pooled last_hidden_state (after the model's final norm)."""
    states = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    v = states[-1] if pooling == "last" else states.mean(0)
    return (v / v.norm() if normalize else v).numpy()


def prompts(lengths: tuple[int, ...], vocab: int, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_vectors_match_transformers_batched_and_chunked(family: str) -> None:
    hf = tiny_hf_model(family)
    engine = engine_for(hf, chunked_prefill_size=5)
    seqs = prompts((3, 12, 17), VOCAB)
    requests = [embed_request(f"{p}{i}", s, p, normalize=i != 1) for i, s in enumerate(seqs) for p in ("last", "mean")]
    batched = run_to_completion(engine, requests)
    for req in requests:
        expected = reference(hf, req.input_ids, req.embed.pooling, req.embed.normalize)  # type: ignore[union-attr]
        np.testing.assert_allclose(vector(batched[req.rid]), expected, rtol=1e-4, atol=1e-5, err_msg=req.rid)
        alone = run_to_completion(engine, [embed_request("again-" + req.rid, req.input_ids, req.embed.pooling,
                                                         req.embed.normalize)])  # type: ignore[union-attr]
        np.testing.assert_allclose(vector(alone["again-" + req.rid]), vector(batched[req.rid]), rtol=1e-4, atol=1e-5)
    engine.check_integrity()


def test_smollm2_beside_generation_and_from_the_prefix_cache(smollm_hf: Any) -> None:
    engine = engine_for(smollm_hf, chunked_prefill_size=16)
    vocab = smollm_hf.config.vocab_size
    text, generating = prompts((40, 9), vocab)
    alone = run_to_completion(engine, [TokenizedRequest("gen", generating, greedy(6))])["gen"]
    engine.flush_cache()
    rows = run_to_completion(engine, [TokenizedRequest("gen2", generating, greedy(6)), embed_request("e", text),
                                      embed_request("m", text, "mean", normalize=False)])
    assert tokens_of(rows["gen2"]) == tokens_of(alone)
    last, mean = vector(rows["e"]), vector(rows["m"])
    np.testing.assert_allclose(last, reference(smollm_hf, text, "last"), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(mean, reference(smollm_hf, text, "mean", normalize=False), rtol=1e-3, atol=1e-3)
    assert abs(float(np.linalg.norm(last)) - 1.0) < 1e-5
    # the prompt is in the prefix cache now: a last-pooled request reuses it, a mean-pooled one cannot
    again = run_to_completion(engine, [embed_request("e2", text), embed_request("m2", text, "mean", normalize=False)])
    assert again["e2"][0].cached_tokens > 0 and again["m2"][0].cached_tokens == 0
    np.testing.assert_allclose(vector(again["e2"]), last, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(vector(again["m2"]), mean, rtol=1e-4, atol=1e-4)
    assert again["e2"][0].prompt_tokens == len(text) and again["e2"][0].completion_tokens == 0


def test_an_embedding_request_must_generate_nothing() -> None:
    engine = engine_for(tiny_hf_model("llama3"))
    error = engine.add_request(TokenizedRequest("x", [5, 6, 7], greedy(3), embed=EmbedParams()))
    assert error is not None and error.param == "max_new_tokens"
