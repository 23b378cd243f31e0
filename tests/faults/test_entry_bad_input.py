"""Inputs that used to crash the server or leak a 500: each ends with a normal result or a 4xx in OpenAI's error
shape, and the server stays healthy with no request left behind."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.server_helpers import ServerHandle, server_info

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MIB = 1024 * 1024


def post(server: ServerHandle, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("extra", [
    {"temperature": 1e-40},  # softmax of logits / 1e-40 is NaN
    {"temperature": 1e-6, "top_p": 1e-9},
    {"top_k": 2**62},  # clamped to the vocabulary
    {"top_k": 2**63},  # does not fit int64
    {"seed": 2**63 - 1},
    {"seed": 2**70},
    {"max_tokens": 10**20},
    {"logit_bias": {"0": 1e308}},
    {"stop_token_ids": [2**64]},
    {"min_p": 1e-300, "repetition_penalty": 1e-300},
])
def test_crash_inputs_end_normally_or_with_400(smollm_server: ServerHandle, extra: dict[str, Any]) -> None:
    response = post(smollm_server, COMPLETIONS, {"prompt": "Hello", "max_tokens": 2, **extra})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert_error(response, 400)
    assert smollm_server.proc.poll() is None


@pytest.mark.parametrize("body,param", [
    ({"prompt": [1, 2, 2**64], "max_tokens": 2}, "prompt"),
    ({"prompt": "hi", "max_tokens": 10**20}, "max_tokens"),
    ({"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    ({"prompt": "hi", "max_tokens": 2, "stop": ["x", "\udfff"]}, "stop"),
    ({"prompt": "hi", "max_tokens": 2, "logit_bias": {"\ud800": 1}}, "logit_bias"),
    ({"prompt": "hi", "max_tokens": 2, "temperature": float("nan")}, "temperature"),
])
def test_values_the_ring_cannot_carry_are_400_naming_the_field(smollm_server: ServerHandle, body: dict[str, Any],
                                                               param: str) -> None:
    # sent as JSON text, as a client in another language would (NaN, "\ud800" escapes)
    raw = json.dumps(body, allow_nan=True)
    response = httpx.post(smollm_server.base_url + COMPLETIONS, content=raw.encode(),
                          headers={"content-type": "application/json"}, timeout=60)
    assert_error(response, 400, param)


def test_lone_surrogate_in_chat_and_generate(smollm_server: ServerHandle) -> None:
    chat = b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}'
    headers = {"content-type": "application/json"}
    response = httpx.post(smollm_server.base_url + CHAT, content=chat, headers=headers, timeout=60)
    assert "messages[0].content" in assert_error(response, 400, "messages")["message"]
    generate = b'{"text": "\\udc00", "sampling_params": {"max_new_tokens": 2}}'
    response = httpx.post(smollm_server.base_url + "/generate", content=generate, headers=headers, timeout=60)
    assert_error(response, 400, "text")


def test_deep_json_is_400(smollm_server: ServerHandle) -> None:
    for depth in (100, 100_000):
        raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b', "max_tokens": 2}'
        response = httpx.post(smollm_server.base_url + COMPLETIONS, content=raw,
                              headers={"content-type": "application/json"}, timeout=60)
        assert "nested too deeply" in assert_error(response, 400)["message"]


def test_oversize_body_is_413_declared_or_streamed(smollm_server: ServerHandle) -> None:
    big = {"prompt": "a" * (3 * MIB), "max_tokens": 2}
    assert_error(post(smollm_server, COMPLETIONS, big), 413)

    def chunks() -> Any:  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(300):
            yield b"a" * 10_000
        yield b'"}'

    response = httpx.post(smollm_server.base_url + COMPLETIONS, content=chunks(),
                          headers={"content-type": "application/json"}, timeout=60)
    assert_error(response, 413)


def test_content_type_must_be_json(smollm_server: ServerHandle) -> None:
    body = b'{"prompt": "Hi", "max_tokens": 1}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"):
        response = httpx.post(smollm_server.base_url + COMPLETIONS, content=body,
                              headers={"content-type": content_type}, timeout=60)
        assert_error(response, 415)
    for content_type in ("application/json", "Application/JSON; charset=UTF-8"):
        response = httpx.post(smollm_server.base_url + COMPLETIONS, content=body,
                              headers={"content-type": content_type}, timeout=60)
        assert response.status_code == 200, response.text
    bare = httpx.post(smollm_server.base_url + COMPLETIONS, content=body, timeout=60)  # httpx sets none here
    assert "content-type" not in bare.request.headers and bare.status_code == 200, bare.text


def test_cors_is_off_by_default(smollm_server: ServerHandle) -> None:
    response = httpx.options(smollm_server.base_url + COMPLETIONS, timeout=10, headers={
        "origin": "https://evil.example", "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in response.headers


def test_server_is_healthy_and_leaks_nothing_afterwards(smollm_server: ServerHandle) -> None:
    assert smollm_server.proc.poll() is None
    assert httpx.get(smollm_server.base_url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 10
    while True:
        info = server_info(smollm_server.base_url)
        if info["entry_live_requests"] == 0 and info["num_running_reqs"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert info["entry_live_requests"] == 0 and info["entry_admitted_total"] == info["entry_terminal_total"], info
