"""Prompt logprobs over HTTP against the real ring and model: OpenAI's echo with logprobs (what
lm-evaluation-harness's log-likelihood tasks send), SGLang's logprob_start_len with max_new_tokens 0, vLLM's
prompt_logprobs. A prompt token's logprob must equal the logprob the same model gave that token when it
generated it."""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest

from tests.server_helpers import ServerHandle, sse_events

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


def post(server: ServerHandle, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.base_url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def generated(server: ServerHandle) -> tuple[list[int], int, float]:
    """The prompt's ids, the greedy next token and its logprob, from /generate."""
    reply = post(server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                       "return_logprob": True, "logprob_start_len": 0})
    prompt_ids = [entry[1] for entry in reply["meta_info"]["input_token_logprobs"]]
    [[logprob, token, _]] = reply["meta_info"]["output_token_logprobs"]
    assert token == reply["output_ids"][0]
    return prompt_ids, token, logprob


def test_generate_scores_the_prompt_from_logprob_start_len(smollm_server: ServerHandle) -> None:
    prompt_ids, token, logprob = generated(smollm_server)
    assert len(prompt_ids) >= 4
    ids = prompt_ids + [token]
    reply = post(smollm_server, "/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "top_logprobs_num": 2,
        "logprob_start_len": 2})
    assert reply["output_ids"] == [] and reply["meta_info"]["finish_reason"]["type"] == "length"
    scored = reply["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in scored] == ids[2:]
    assert all(e[0] is not None and e[0] <= 0 for e in scored)
    assert math.isclose(scored[-1][0], logprob, abs_tol=2e-3), "scoring a token gives the logprob it was made with"
    top = reply["meta_info"]["input_top_logprobs"]
    assert len(top) == len(scored) and top[-1][0][1] == token, "the greedy token tops its position"
    full = post(smollm_server, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                             "return_logprob": True, "logprob_start_len": 0})
    first = full["meta_info"]["input_token_logprobs"][0]
    assert first[0] is None and full["meta_info"]["input_top_logprobs"][0] is None
    assert [e[0] for e in full["meta_info"]["input_token_logprobs"][2:]] == pytest.approx([e[0] for e in scored],
                                                                                       abs=1e-4)


def test_generate_logprob_start_len_is_checked(smollm_server: ServerHandle) -> None:
    for body in ({"logprob_start_len": 0}, {"return_logprob": True, "logprob_start_len": 99}):
        response = httpx.post(smollm_server.base_url + "/generate", timeout=60,
                              json={"text": "hi", "sampling_params": {"max_new_tokens": 1}, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == "logprob_start_len", body


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt(smollm_server: ServerHandle, max_tokens: int) -> None:
    """lm-evaluation-harness's log-likelihood request."""
    prompt_ids, token, logprob = generated(smollm_server)
    reply = post(smollm_server, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1,
                                                    "max_tokens": max_tokens, "temperature": 0})
    [choice] = reply["choices"]
    lp = choice["logprobs"]
    n = reply["usage"]["prompt_tokens"]
    assert n == len(prompt_ids) and len(lp["tokens"]) == n + max_tokens == len(lp["token_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert choice["text"].startswith(PROMPT)
    if max_tokens:
        assert math.isclose(lp["token_logprobs"][-1], logprob, abs_tol=2e-3)
    else:
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"


def test_the_openai_client_reads_echoed_prompt_logprobs(smollm_server: ServerHandle) -> None:
    client = openai.OpenAI(base_url=f"{smollm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs[0] is None
    assert len(logprobs.tokens) == reply.usage.prompt_tokens and all(len(t) == 2 for t in logprobs.top_logprobs[1:])


def test_vllm_prompt_logprobs(smollm_server: ServerHandle) -> None:
    prompt_ids, _, _ = generated(smollm_server)
    reply = post(smollm_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    scored = reply["choices"][0]["prompt_logprobs"]
    assert reply["choices"][0]["logprobs"] is None, "output logprobs were not asked for"
    assert len(scored) == len(prompt_ids) and scored[0] is None
    for token, entry in zip(prompt_ids[1:], scored[1:]):
        assert str(token) in entry and entry[str(token)]["rank"] >= 1
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] and len(entry) in (2, 3)
    chat = post(smollm_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 1, "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    for body, why in (({"stream": True}, "stream"), ({"logprobs": 1}, "must equal")):
        response = httpx.post(smollm_server.base_url + "/v1/completions", timeout=60,
                              json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"
        assert why in response.json()["error"]["message"]


def test_vllm_return_token_ids(smollm_server: ServerHandle) -> None:
    prompt_ids, token, _ = generated(smollm_server)
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    [choice] = post(smollm_server, "/v1/completions", body)["choices"]
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 3
    assert choice["token_ids"][0] == token
    with httpx.stream("POST", smollm_server.base_url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as response:
        chunks = [e for e in sse_events(response) if e != "[DONE]"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    chat = post(smollm_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 2, "return_token_ids": True})
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    native = post(smollm_server, "/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 1, "return_prompt_ids": True}})
    assert native["meta_info"]["prompt_token_ids"] == prompt_ids
    plain = post(smollm_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
