"""What the ring generates: greedy equality with transformers (alone and in shared batches), streaming
equals non-streaming, stop strings split across tokens never leak, finish reasons."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.engine_helpers import assert_greedy_matches, hf_greedy
from tests.server_helpers import ServerHandle, sse_events, wait_until_idle

PROMPTS = [
    "What is the capital of France?",
    "用一句话介绍你自己 😀",
    "Write a haiku about the sea.",
    "こんにちは！元気ですか？",
    "Give me a fun fact about octopuses 🐙.",
    "Explain gravity to a child in one sentence.",
    "Translate 'good morning' into Spanish and French.",
    "List three colors.",
    "What is 12 * 7?",
]
MAX_NEW = 20


@pytest.fixture(scope="module")
def hf_reference(smollm_hf: Any) -> dict[str, Any]:
    """transformers' own greedy `generate` on the same GGUF: the ground truth."""
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"))
    model = smollm_hf
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)) for p in PROMPTS]
    outputs = [hf_greedy(model, ids, MAX_NEW, tokenizer.eos_token_id) for ids in prompts]
    return {"model": model, "tokenizer": tokenizer, "prompts": prompts, "outputs": outputs}


def generate_ids(base_url: str, prompt_ids: list[int]) -> list[int]:
    body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    response = httpx.post(base_url + "/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def test_greedy_matches_transformers_alone(smollm_server: ServerHandle, hf_reference: dict[str, Any]) -> None:
    for prompt_ids, expected in list(zip(hf_reference["prompts"], hf_reference["outputs"]))[:3]:
        got = generate_ids(smollm_server.base_url, prompt_ids)
        assert_greedy_matches(hf_reference["model"], prompt_ids, expected, got)


def test_greedy_matches_transformers_in_shared_batches(smollm_server: ServerHandle,
                                                       hf_reference: dict[str, Any]) -> None:
    prompts = hf_reference["prompts"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda ids: generate_ids(smollm_server.base_url, ids), prompts))
    for prompt_ids, expected, got in zip(prompts, hf_reference["outputs"], results):
        assert_greedy_matches(hf_reference["model"], prompt_ids, expected, got)
    assert wait_until_idle(smollm_server.base_url)["kv_running_tokens"] == 0


def test_chat_text_equals_transformers_text(smollm_server: ServerHandle, hf_reference: dict[str, Any]) -> None:
    tokenizer = hf_reference["tokenizer"]
    for prompt, expected in list(zip(PROMPTS, hf_reference["outputs"]))[:2]:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_NEW, "temperature": 0}
        reply = httpx.post(smollm_server.base_url + "/v1/chat/completions", json=body, timeout=120).json()
        # a character whose bytes max_tokens cut off is dropped, not sent as U+FFFD (the CJK prompt hits this)
        hf_text = tokenizer.decode(expected, skip_special_tokens=True).rstrip("\ufffd")
        assert reply["choices"][0]["message"]["content"] == hf_text


@pytest.mark.parametrize("prompt", [PROMPTS[1], PROMPTS[3], PROMPTS[4]])
def test_stream_equals_non_stream_without_broken_characters(smollm_server: ServerHandle, prompt: str) -> None:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0}
    url = smollm_server.base_url + "/v1/chat/completions"
    full = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == full["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["finish_reason"]


def test_finish_reasons(smollm_server: ServerHandle) -> None:
    url = smollm_server.base_url + "/v1/chat/completions"
    short = {"messages": [{"role": "user", "content": "What is 2+2? Reply with just the number."}], "temperature": 0}
    stopped = httpx.post(url, json={**short, "max_tokens": 64}, timeout=120).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] < 64
    assert stopped["choices"][0]["matched_stop"] == 2  # <|im_end|>, never shown as text
    assert "<|im_end|>" not in stopped["choices"][0]["message"]["content"]
    cut = httpx.post(url, json={**short, "max_tokens": 1}, timeout=120).json()
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 1


def test_stop_string_split_across_tokens_never_leaks(smollm_server: ServerHandle,
                                                     hf_reference: dict[str, Any]) -> None:
    tokenizer = hf_reference["tokenizer"]
    prompt = "Write a haiku about the sea."
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 30, "temperature": 0}
    url = smollm_server.base_url + "/v1/chat/completions"
    text = httpx.post(url, json=body, timeout=120).json()["choices"][0]["message"]["content"]
    ids = tokenizer.encode(text)
    # a stop string made of the end of one token and the start of the next
    for k in range(3, len(ids) - 1):
        left, right = tokenizer.decode(ids[k - 1:k]), tokenizer.decode(ids[k:k + 1])
        if len(left.strip()) >= 2 and len(right.strip()) >= 2:
            stop = left[-2:] + right[:2]
            if text.find(stop) == len(tokenizer.decode(ids[:k])) - 2:
                break
    else:
        pytest.fail(f"no token boundary to build a split stop string from in {text!r}")
    expected = text[:text.find(stop)]
    with httpx.stream("POST", url, json={**body, "stop": [stop], "stream": True}, timeout=120) as response:
        chunks = [e for e in sse_events(response) if e != "[DONE]"]
    sent = ""
    for chunk in chunks:
        sent += chunk["choices"][0]["delta"].get("content", "")
        assert expected.startswith(sent), f"leaked past the stop {stop!r}: {sent!r}"
    assert sent == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["matched_stop"] == stop
    full = httpx.post(url, json={**body, "stop": [stop]}, timeout=120).json()["choices"][0]
    assert full["message"]["content"] == expected and full["finish_reason"] == "stop"
