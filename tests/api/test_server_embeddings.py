"""`POST /v1/embeddings` through the real ring with the official `openai` client: SmolLM2's own pooled hidden
states (as transformers computes them), float and base64 alike, `dimensions`, list and token-id inputs in
order, usage, ringserve's pooling and normalize, and 400s naming the field."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

import ringserve
from ringserve.actors.common.model_source import load_tokenizer, resolve_model
from ringserve.bus.errors import ApiError
from tests.conftest import DEFAULT_MODEL
from tests.server_helpers import ServerHandle, server_info, wait_for, wait_until_idle

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings from the same server.", "ok"]


@pytest.fixture(scope="module")
def client(smollm_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm_server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model(DEFAULT_MODEL))


def vectors(reply: Any) -> list[np.ndarray]:
    assert [d.index for d in reply.data] == list(range(len(reply.data)))
    return [np.asarray(d.embedding, dtype=np.float32) for d in reply.data]


def test_vectors_are_the_models_pooled_states(client: openai.OpenAI, tokenizer: Any, smollm_hf: Any) -> None:
    reply = client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS)
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert reply.object == "list" and reply.model == DEFAULT_MODEL
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(i) for i in ids)
    got = vectors(reply)
    with torch.no_grad():
        for v, prompt in zip(got, ids):
            state = smollm_hf.model(torch.tensor([prompt])).last_hidden_state[0, -1].float()
            np.testing.assert_allclose(v, (state / state.norm()).numpy(), rtol=1e-3, atol=1e-4)
    # token ids in (one list, and a list of lists) give the same vectors, in order
    np.testing.assert_allclose(vectors(client.embeddings.create(model=DEFAULT_MODEL, input=ids[0]))[0], got[0],
                               rtol=1e-4, atol=1e-5)
    by_ids = vectors(client.embeddings.create(model=DEFAULT_MODEL, input=ids[::-1]))
    for v, expected in zip(by_ids, got[::-1]):
        np.testing.assert_allclose(v, expected, rtol=1e-4, atol=1e-5)


def test_base64_dimensions_pooling_and_normalize(client: openai.OpenAI) -> None:
    plain = vectors(client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS[0], encoding_format="float"))[0]
    # the openai client asks for base64 by default and decodes it itself; ask for it explicitly through httpx too
    decoded = np.asarray(client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS[0]).data[0].embedding,
                         dtype=np.float32)
    np.testing.assert_array_equal(decoded, plain)
    raw = httpx.post(str(client.base_url) + "embeddings", json={"input": TEXTS[0], "encoding_format": "base64"},
                     timeout=60).json()
    assert isinstance(raw["data"][0]["embedding"], str)
    cut = vectors(client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS[0], dimensions=16))[0]
    assert cut.shape == (16,) and abs(float(np.linalg.norm(cut)) - 1) < 1e-5
    np.testing.assert_allclose(cut, plain[:16] / np.linalg.norm(plain[:16]), rtol=1e-5, atol=1e-6)
    raw_mean = vectors(client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS[0],
                                                extra_body={"pooling": "mean", "normalize": False}))[0]
    assert raw_mean.shape == plain.shape and abs(float(np.linalg.norm(raw_mean)) - 1) > 1e-2
    assert not np.allclose(raw_mean / np.linalg.norm(raw_mean), plain, atol=1e-3)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": ""}, "input"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 100000}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "pooling": "max"}, "pooling"),
    ({"input": "hi", "temperature": 0.5}, "temperature"),
    ({"input": [[10 ** 9]]}, "input"),
    ({"input": "word " * 9000}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(client: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        rest = dict(body)
        client.embeddings.create(model=DEFAULT_MODEL, input=rest.pop("input"), extra_body=rest)
    assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]


def test_the_python_engine_embeds_over_nats(smollm_server: ServerHandle, client: openai.OpenAI) -> None:
    expected = vectors(client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS[:2], dimensions=32))
    with ringserve.Engine(nats_url=smollm_server.nats_url, namespace=smollm_server.namespace) as engine:
        got = engine.embed(TEXTS[:2], dimensions=32)
        one = engine.embed(TEXTS[0], pooling="mean", normalize=False)
        with pytest.raises(ApiError) as caught:
            engine.embed(TEXTS[0], pooling="max")
    assert caught.value.param == "pooling"
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), np.stack(expected), rtol=1e-4, atol=1e-5)
    assert isinstance(one[0], float) and len(one) == hidden_size(client)


def hidden_size(client: openai.OpenAI) -> int:
    return len(client.embeddings.create(model=DEFAULT_MODEL, input="x", encoding_format="float").data[0].embedding)


def test_prompt_tokens_are_counted_in_the_metrics(smollm_server: ServerHandle, client: openai.OpenAI) -> None:
    def prompt_tokens_total() -> float:
        text = httpx.get(smollm_server.base_url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("ringserve:prompt_tokens_total"))

    wait_until_idle(smollm_server.base_url)
    before = prompt_tokens_total()
    reply = client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS)
    wait_until_idle(smollm_server.base_url)
    assert prompt_tokens_total() - before == reply.usage.prompt_tokens


def test_an_aborted_embedding_is_a_503_not_an_empty_vector(smollm_server: ServerHandle) -> None:
    base = smollm_server.base_url
    assert httpx.post(base + "/pause_generation", json={}, timeout=30).json()["success"] is True
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(httpx.post, base + "/v1/embeddings", json={"input": TEXTS[0]}, timeout=60)
            assert wait_for(lambda: server_info(base)["num_waiting_reqs"] == 1)
            assert httpx.post(base + "/abort_request", json={"abort_all": True}, timeout=30).status_code == 200
            answer = reply.result()
    finally:
        httpx.post(base + "/continue_generation", json={}, timeout=30)
    assert answer.status_code == 503 and "without its vector (abort)" in answer.json()["error"]["message"]
