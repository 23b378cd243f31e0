"""OpenAI conformance of the /v1 routes against the real ring: lists of prompts with n (prompt-major choices,
summed usage), echo, /v1/models/{id}, the role-only first chat chunk, stream_options without stream, choice
seeds that wrap at 2^63, and the one table of accepted, refused and unknown body fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ringserve.actors.entry.openai.protocol import NO_EFFECT, REFUSED, ROUTE_FIELDS, STREAM_OPTIONS_NO_EFFECT
from tests.server_helpers import ServerHandle, sse_events

MODEL = "SmolLM2-135M-Instruct"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Name a colour."}]
PROMPTS = ["The capital of France is", "My favourite animal is"]
SAMPLED = {"max_tokens": 4, "temperature": 1.0, "seed": 11, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(smollm_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def token_prompts() -> list[list[int]]:
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(MODEL))
    return [tokenizer.encode(p) for p in PROMPTS]


def post(server: ServerHandle, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def completion(server: ServerHandle, body: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed completion, or the streamed one put back together (text per choice, the usage chunk)."""
    if not body.get("stream"):
        response = post(server, COMPLETIONS, body)
        assert response.status_code == 200, response.text
        return response.json()
    with httpx.stream("POST", server.base_url + COMPLETIONS, timeout=120,
                      json={**body, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200, response.read()
        events = list(sse_events(response))
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for event in events[:-2]:
        [choice] = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert sorted(texts) == list(range(len(texts))) and sorted(finishes) == sorted(texts)
    return {"choices": [{"index": i, "text": texts[i], "finish_reason": finishes[i]} for i in sorted(texts)],
            "usage": events[-2]["usage"]}


def assert_400(response: httpx.Response, param: str, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param, error
    return error


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("form", ["strings", "token_ids"])
def test_list_of_prompts_gives_n_choices_per_prompt_prompt_major(
        smollm_server: ServerHandle, token_prompts: list[list[int]], form: str, stream: bool) -> None:
    prompts: list[Any] = PROMPTS if form == "strings" else token_prompts
    reply = completion(smollm_server, {"prompt": prompts, "n": 2, "stream": stream, **SAMPLED})
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    # choice p * n + i is sample i of prompt p: the same text as prompt p alone with seed + i
    singles = [completion(smollm_server, {"prompt": prompts[p], **SAMPLED, "seed": SAMPLED["seed"] + i})
               for p in (0, 1) for i in (0, 1)]
    assert [c["text"] for c in reply["choices"]] == [s["choices"][0]["text"] for s in singles]
    usage = reply["usage"]
    assert usage["completion_tokens"] == 4 * 4
    assert usage["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"] + singles[2]["usage"]["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_openai_client_sends_a_list_of_prompts(client: openai.OpenAI, token_prompts: list[list[int]]) -> None:
    reply = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=3, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1]
    for prompt, choice in zip(PROMPTS, reply.choices):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
        assert choice.text == alone.choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=token_prompts, max_tokens=3, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in reply.choices]
    assert by_ids.usage.prompt_tokens == sum(len(ids) for ids in token_prompts)


def test_too_many_choices_or_a_bad_prompt_list_is_a_400(smollm_server: ServerHandle) -> None:
    error = assert_400(post(smollm_server, COMPLETIONS, {"prompt": ["hi"] * 129, "n": 2, "max_tokens": 1}),
                       "prompt")
    assert "129 prompts" in error["message"] and "256" in error["message"]
    for prompt in ([], [[]], ["hi", 3], [["hi"]], [[1, "x"]]):
        assert_400(post(smollm_server, COMPLETIONS, {"prompt": prompt, "max_tokens": 1}), "prompt")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_puts_the_prompt_before_each_choice(smollm_server: ServerHandle, stream: bool) -> None:
    plain = completion(smollm_server, {"prompt": PROMPTS, "n": 2, **SAMPLED})
    echoed = completion(smollm_server, {"prompt": PROMPTS, "n": 2, "echo": True, "stream": stream, **SAMPLED})
    assert [c["text"] for c in echoed["choices"]] == [PROMPTS[k // 2] + c["text"]
                                                      for k, c in enumerate(plain["choices"])]
    assert echoed["usage"] == plain["usage"]


def test_echo_with_the_openai_client_and_token_id_prompts(client: openai.OpenAI, smollm_server: ServerHandle,
                                                         token_prompts: list[list[int]]) -> None:
    """A token-id prompt echoes as its decoded text (a tokenizer decodes it); one outside the vocabulary is a
    400 naming the prompt."""
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True)
    alone = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=False)
    assert reply.choices[0].text == PROMPTS[0] + alone.choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=[token_prompts[1], PROMPTS[0]], max_tokens=3,
                                       temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(PROMPTS[1]) and by_ids.choices[1].text == reply.choices[0].text
    assert_400(post(smollm_server, COMPLETIONS, {"prompt": [10**7], "echo": True, "max_tokens": 1}), "prompt")


def test_best_of_must_be_1_or_n(smollm_server: ServerHandle) -> None:
    reply = completion(smollm_server, {"prompt": "hi", "n": 2, "best_of": 2, **SAMPLED})
    assert len(reply["choices"]) == 2
    assert_400(post(smollm_server, COMPLETIONS, {"prompt": "hi", "best_of": 3, "max_tokens": 1}), "best_of")


def test_models_retrieve_the_served_id_and_404_otherwise(client: openai.OpenAI,
                                                         smollm_server: ServerHandle) -> None:
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.owned_by == "ringserve"
    assert card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("org/no-such-model")  # sent as org%2Fno-such-model
    assert err.value.body["param"] == "model" and "no-such-model" in err.value.body["message"]
    error = assert_400(httpx.get(smollm_server.base_url + "/v1/models/gpt-4", timeout=30), "model", 404)
    assert error["type"] == "model_not_found"


@pytest.mark.parametrize("n", [1, 2])
def test_each_streamed_chat_choice_starts_with_a_role_only_chunk(smollm_server: ServerHandle, n: int) -> None:
    body = {"messages": MSG, "n": n, "max_tokens": 5, "temperature": 1.0, "seed": 4, "logprobs": True}
    whole = post(smollm_server, CHAT, body).json()
    with httpx.stream("POST", smollm_server.base_url + CHAT, json={**body, "stream": True}, timeout=120) as r:
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    for index in range(n):
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == index]
        first, rest = chunks[0], chunks[1:]
        assert first["delta"] == {"role": "assistant", "content": ""}
        assert first["finish_reason"] is None and first["logprobs"] is None
        assert rest and all("role" not in c["delta"] for c in rest)
        assert "".join(c["delta"].get("content", "") for c in rest) == whole["choices"][index]["message"]["content"]
        streamed = [e["token"] for c in rest if c["logprobs"] for e in c["logprobs"]["content"]]
        assert streamed == [e["token"] for e in whole["choices"][index]["logprobs"]["content"]]


def test_openai_client_sees_the_role_first(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks[1:])


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": MSG}), (COMPLETIONS, {"prompt": "hi"})])
def test_stream_options_without_stream_is_a_400(smollm_server: ServerHandle, path: str, body: dict) -> None:
    for stream in ({}, {"stream": False}):
        error = assert_400(post(smollm_server, path, {**body, **stream, "max_tokens": 1,
                                                      "stream_options": {"include_usage": True}}),
                           "stream_options")
        assert "stream" in error["message"]
    assert_400(post(smollm_server, path, {**body, "max_tokens": 1, "stream": True,
                                          "stream_options": {"include_usage": True, "bogus": 1}}),
               "stream_options")


def test_seed_near_2_63_wraps_for_each_choice(client: openai.OpenAI) -> None:
    request = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    reply = client.completions.create(**request, n=3, seed=2**63 - 1)
    assert len(reply.choices) == 3
    texts = [c.text for c in reply.choices]
    assert texts[0] == client.completions.create(**request, seed=2**63 - 1).choices[0].text
    assert texts[1] == client.completions.create(**request, seed=0).choices[0].text
    assert texts[2] == client.completions.create(**request, seed=1).choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, n=3, seed=2**63 - 2)
    assert len(chat.choices) == 3


REFUSED_VALUES = {
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto", "functions": [{"name": "f"}], "function_call": "auto", "parallel_tool_calls": True,
    "prediction": {"type": "content", "content": "x"}, "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "reasoning_effort": "low", "verbosity": "low",
    "web_search_options": {}, "suffix": " and so on",
    "chat_template_kwargs": {"enable_thinking": False}, "thinking_token_budget": 8,
}
NEUTRAL_VALUES = {"tools": [], "tool_choice": "none",
                  "modalities": ["text"], "suffix": ""}
NO_EFFECT_VALUES = {"user": "user-42", "safety_identifier": "h42", "metadata": {"k": "v"}, "store": False,
                    "service_tier": "auto", "prompt_cache_key": "k1"}


# a REFUSED field is refused where its route does not implement it (chat implements the tool fields)
REFUSED_CASES = [(path, body, name) for kind, path, body in (("chat", CHAT, {"messages": MSG}),
                                                             ("completion", COMPLETIONS, {"prompt": "hi"}))
                 for name in sorted(REFUSED) if name not in ROUTE_FIELDS[kind]]


@pytest.mark.parametrize("path, body, name", REFUSED_CASES,
                         ids=[f"{'chat' if p == CHAT else 'completions'}-{n}" for p, _, n in REFUSED_CASES])
def test_refused_fields_are_a_400_naming_them(smollm_server: ServerHandle, path: str, body: dict,
                                              name: str) -> None:
    error = assert_400(post(smollm_server, path, {**body, "max_tokens": 1, name: REFUSED_VALUES[name]}), name)
    assert name in error["message"]


def test_openai_client_gets_a_400_for_tools_on_completions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    assert err.value.body["param"] == "tools" and "chat/completions only" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, functions=[{"name": "f"}])
    assert err.value.body["param"] == "functions" and "use tools" in err.value.body["message"]


@pytest.mark.parametrize("path, body, key", [(CHAT, {"messages": MSG}, ("message", "content")),
                                             (COMPLETIONS, {"prompt": "The sky is"}, ("text",))],
                         ids=["chat", "completions"])
def test_fields_that_change_nothing_are_accepted(smollm_server: ServerHandle, path: str, body: dict,
                                                 key: tuple[str, ...]) -> None:
    def text(extra: dict) -> str:
        response = post(smollm_server, path, {**body, "max_tokens": 4, "temperature": 0, **extra})
        assert response.status_code == 200, response.text
        value = response.json()["choices"][0]
        for part in key:
            value = value[part]
        return value

    baseline = text({})
    refused_null = {name: None for name in REFUSED}
    assert text({**NO_EFFECT_VALUES, **NEUTRAL_VALUES}) == baseline
    assert text(refused_null) == baseline
    # accepted because the table lists them: the same values under names it does not list are refused
    for name, value in NO_EFFECT_VALUES.items():
        assert_400(post(smollm_server, path, {**body, "max_tokens": 1, f"{name}_x": value}), f"{name}_x")
    with httpx.stream("POST", smollm_server.base_url + path, timeout=120, json={
            **body, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, **{k: True for k in STREAM_OPTIONS_NO_EFFECT}}}) as r:
        assert r.status_code == 200 and list(sse_events(r))[-1] == "[DONE]"


@pytest.mark.parametrize("path, body, name", [
    (CHAT, {"messages": MSG}, "frobnicate"),
    (CHAT, {"messages": MSG}, "echo"),  # a completions field
    (CHAT, {"messages": MSG}, "prompt"),
    (COMPLETIONS, {"prompt": "hi"}, "messages"),  # a chat field
    (COMPLETIONS, {"prompt": "hi"}, "top_logprobs"),
    (COMPLETIONS, {"prompt": "hi"}, "add_generation_prompt"),
    (COMPLETIONS, {"prompt": "hi"}, "rid"),
], ids=lambda v: v if isinstance(v, str) and not v.startswith("/") else None)
def test_unknown_fields_are_a_400_naming_them(smollm_server: ServerHandle, path: str, body: dict,
                                              name: str) -> None:
    error = assert_400(post(smollm_server, path, {**body, "max_tokens": 1, name: 1}), name)
    assert "Unrecognized request argument" in error["message"] and name in error["message"]


def test_docs_and_these_tests_cover_the_field_table() -> None:
    assert set(REFUSED_VALUES) == set(REFUSED) and set(NEUTRAL_VALUES) <= set(REFUSED)
    assert set(NO_EFFECT_VALUES) == set(NO_EFFECT)
    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    routes = api[api.index("## Routes"):api.index("## Request parameters")]
    for name in [*NO_EFFECT, *REFUSED, *(f"stream_options.{name}" for name in STREAM_OPTIONS_NO_EFFECT)]:
        assert f"`{name}`" in routes, name
    assert "/v1/models/{id}" in routes
