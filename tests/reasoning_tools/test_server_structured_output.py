"""Structured output against the real ring:
`response_format` (json_object, json_schema), vLLM's `guided_*`, and native `json_schema`, `regex`, `ebnf` on
/generate give output that parses and validates every time (greedy, sampled, streamed, n > 1, warm prefix
cache); max_tokens cutting JSON short finishes with `length`; an unconstrained request batched beside a
constrained one is unchanged; each invalid constraint is a 400 naming the field the client sent, and the server
serves the next request."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.server_helpers import ServerHandle, sse_events

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
MSG = [{"role": "system", "content": "You are a careful assistant that describes colours for a paint catalogue. "
                                     "Answer briefly."},
       {"role": "user", "content": "Describe a colour as JSON."}]
# every value bounded, so a constrained reply always closes within a few tokens
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
          "required": ["colour", "bright"]}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA, "strict": True}}


def valid(text: str) -> bool:
    """Whether `text` is JSON valid under SCHEMA (checked by hand: keys, enum, type)."""
    value = json.loads(text)
    return (isinstance(value, dict) and set(value) == {"colour", "bright"} and value["colour"] in ("red", "green", "blue")
            and isinstance(value["bright"], bool))


def post(server: ServerHandle, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def chat(server: ServerHandle, **body: Any) -> dict[str, Any]:
    response = post(server, CHAT, {"messages": MSG, "max_tokens": 24, **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def client(smollm_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_json_object_and_json_schema_greedy(smollm_server: ServerHandle) -> None:
    reply = chat(smollm_server, response_format={"type": "json_object"}, max_tokens=48, temperature=0)
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["message"]["content"]), dict)
    [choice] = chat(smollm_server, response_format=SCHEMA_FORMAT, temperature=0)["choices"]
    assert choice["finish_reason"] == "stop" and valid(choice["message"]["content"])
    # /v1/completions takes response_format too
    response = post(smollm_server, "/v1/completions", {"prompt": "A colour as JSON:", "max_tokens": 24,
                                                       "temperature": 0, "response_format": SCHEMA_FORMAT})
    assert response.status_code == 200, response.text
    assert valid(response.json()["choices"][0]["text"])


def test_json_schema_sampled_with_seeds_and_openai_client(client: openai.OpenAI) -> None:
    for seed in range(4):
        reply = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=24, temperature=1.0, seed=seed,
                                               response_format=SCHEMA_FORMAT)
        assert reply.choices[0].finish_reason == "stop" and valid(reply.choices[0].message.content)


def test_json_schema_streamed_with_n(smollm_server: ServerHandle) -> None:
    with httpx.stream("POST", smollm_server.base_url + CHAT, timeout=120, json={
            "messages": MSG, "max_tokens": 24, "temperature": 1.0, "seed": 5, "n": 3, "stream": True,
            "response_format": SCHEMA_FORMAT}) as response:
        assert response.status_code == 200, response.read()
        events = list(sse_events(response))
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for event in events[:-1]:
        [choice] = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert events[-1] == "[DONE]" and finishes == {0: "stop", 1: "stop", 2: "stop"}
    assert all(valid(texts[i]) for i in range(3)), texts


def test_json_schema_with_the_prefix_cache_warm(smollm_server: ServerHandle) -> None:
    first = chat(smollm_server, response_format=SCHEMA_FORMAT, temperature=0)
    second = chat(smollm_server, response_format=SCHEMA_FORMAT, temperature=0)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    texts = [reply["choices"][0]["message"]["content"] for reply in (first, second)]
    assert texts[0] == texts[1] and valid(texts[1])


def test_max_tokens_cutting_json_short_finishes_with_length(smollm_server: ServerHandle) -> None:
    [choice] = chat(smollm_server, response_format=SCHEMA_FORMAT, temperature=0, max_tokens=3)["choices"]
    assert choice["finish_reason"] == "length"
    with pytest.raises(ValueError):
        json.loads(choice["message"]["content"])


def test_regex_and_ebnf_on_generate_and_guided_fields(smollm_server: ServerHandle) -> None:
    pattern = r"(yes|no), [0-9]{3}"
    for seed in range(3):
        response = post(smollm_server, "/generate", {"text": "Answer: ", "sampling_params": {
            "regex": pattern, "max_new_tokens": 16, "temperature": 1.0, "seed": seed}})
        assert response.status_code == 200, response.text
        assert re.fullmatch(pattern, response.json()["text"]), response.json()["text"]
    grammar = 'root ::= "Code " [A-Z] [0-9] [0-9] ("!" | "?")'
    response = post(smollm_server, "/generate", {"text": "The code is", "sampling_params": {
        "ebnf": grammar, "max_new_tokens": 16, "temperature": 0}})
    assert response.status_code == 200, response.text
    assert re.fullmatch(r"Code [A-Z][0-9]{2}[!?]", response.json()["text"]), response.json()["text"]
    [choice] = chat(smollm_server, guided_choice=["crimson", "teal"], temperature=0)["choices"]
    assert choice["message"]["content"] in ("crimson", "teal")
    [choice] = chat(smollm_server, guided_json=SCHEMA, temperature=0)["choices"]
    assert valid(choice["message"]["content"])


def test_unconstrained_request_beside_a_constrained_one_is_unchanged(smollm_server: ServerHandle) -> None:
    plain = {"messages": MSG, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    solo = chat(smollm_server, **plain)["choices"][0]["message"]["content"]
    constrained = {"messages": MSG, "max_tokens": 24, "temperature": 1.0, "seed": 3, "response_format": SCHEMA_FORMAT}
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post, smollm_server, CHAT, body) for body in (constrained, plain, constrained)]
        replies = [future.result() for future in futures]
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert replies[1].json()["choices"][0]["message"]["content"] == solo
    assert valid(replies[0].json()["choices"][0]["message"]["content"])


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format"),
    (CHAT, {"response_format": "json"}, "response_format"),
    (CHAT, {"guided_regex": "(unclosed"}, "guided_regex"),
    (CHAT, {"guided_grammar": "root ::= "}, "guided_grammar"),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     "response_format"),
    ("/generate", {"sampling_params": {"json_schema": json.dumps(BAD_SCHEMA)}}, "json_schema"),
    ("/generate", {"sampling_params": {"regex": "(unclosed"}}, "regex"),
    ("/generate", {"sampling_params": {"ebnf": "root ::= "}}, "ebnf"),
    ("/generate", {"sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "ebnf"),
], ids=lambda v: v if isinstance(v, str) and not v.startswith("/") and v.isidentifier() else None)
def test_invalid_constraints_are_a_400_naming_the_field(smollm_server: ServerHandle, path: str, body: dict,
                                                        param: str) -> None:
    prompt = {"messages": MSG} if path == CHAT else {"prompt": "hi"} if path.startswith("/v1") else {"text": "hi"}
    response = post(smollm_server, path, {**prompt, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    [choice] = chat(smollm_server, response_format=SCHEMA_FORMAT, temperature=0)["choices"]  # still serving
    assert valid(choice["message"]["content"])


def test_response_format_text_changes_nothing(smollm_server: ServerHandle) -> None:
    plain = chat(smollm_server, temperature=0, max_tokens=6)["choices"][0]["message"]["content"]
    text = chat(smollm_server, temperature=0, max_tokens=6, response_format={"type": "text"})
    assert text["choices"][0]["message"]["content"] == plain
