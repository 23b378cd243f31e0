"""The HTTP surface against the real ring: the official OpenAI client, error bodies, info endpoints."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server_helpers import ServerHandle, server_info, sse_events

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(smollm_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_chat_non_stream(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 5 and 1 <= reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                           max_tokens=6, temperature=0)
    assert text == again.choices[0].message.content


def test_completions(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert reply.choices[0].text and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True))
    assert streamed == reply.choices[0].text


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=16,
                                          temperature=1.0, top_p=0.95, seed=seed, extra_body={"top_k": 50})
        return reply.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_openai_client_sees_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=1.5)
    assert err.value.status_code == 400 and "top_p" in str(err.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])


CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"messages": MSG, "temperature": -1}, "temperature"),
    (CHAT, {"messages": MSG, "temperature": "NaN"}, "temperature"),
    (CHAT, {"messages": MSG, "top_p": 0}, "top_p"),
    (CHAT, {"messages": MSG, "top_p": 1.01}, "top_p"),
    (CHAT, {"messages": MSG, "top_k": 1.5}, "top_k"),
    (CHAT, {"messages": MSG, "max_tokens": -1}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 10_000_000}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi " * 10_000}], "max_tokens": 5}, "messages"),  # > context
    ("/v1/completions", {"prompt": "hi " * 10_000, "max_tokens": 5}, "prompt"),
    ("/generate", {"text": "hi " * 10_000}, "text"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": MSG, "stream": True, "top_k": "x"}, "top_k"),
    (CHAT, {"messages": MSG, "n": 99}, "n"),
    (CHAT, {"messages": MSG, "echo": True}, "echo"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("/generate", {"text": "hi", "rid": "bad.rid"}, "rid"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
])
def test_invalid_requests_get_openai_400_and_the_server_keeps_working(
        smollm_server: ServerHandle, path: str, body: dict, param: str) -> None:
    if body.get("temperature") == "NaN":
        content = b'{"messages": [{"role": "user", "content": "hello"}], "temperature": NaN}'
        response = httpx.post(smollm_server.base_url + path, content=content, timeout=60)
    else:
        response = httpx.post(smollm_server.base_url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == 400 and error["message"]
    ok = httpx.post(smollm_server.base_url + CHAT, json={"messages": MSG, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_malformed_json_is_a_400(smollm_server: ServerHandle) -> None:
    response = httpx.post(smollm_server.base_url + CHAT, content=b"{not json", timeout=30)
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_generate_native_stream_and_non_stream(smollm_server: ServerHandle) -> None:
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    full = httpx.post(smollm_server.base_url + "/generate", json=body, timeout=60).json()
    assert len(full["output_ids"]) == 12 and full["meta_info"]["finish_reason"]["type"] == "length"
    with httpx.stream("POST", smollm_server.base_url + "/generate", json={**body, "stream": True, "stream_deltas": True},
                      timeout=60) as r:
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    assert "".join(e["text"] for e in events[:-1]) == full["text"]
    assert [t for e in events[:-1] for t in e["output_ids"]] == full["output_ids"]


def test_health_and_server_info(smollm_server: ServerHandle) -> None:
    assert httpx.get(smollm_server.base_url + "/health", timeout=10).json()["status"] == "ok"
    info = server_info(smollm_server.base_url)
    for key in ("num_running_reqs", "num_waiting_reqs", "kv_used_tokens", "kv_total_tokens"):
        assert isinstance(info[key], int)
    assert info["kv_total_tokens"] > 0 and info["context_length"] == 8192
