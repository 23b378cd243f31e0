"""Anthropic's Messages API (`POST /v1/messages`) with the official `anthropic` client against the real ring:
SmolLM2 through the chat path (the same greedy text as a chat completion), streamed and not, stop sequences,
max_tokens, a forced tool call and its result, tool use streamed as input_json_delta, errors in Anthropic's
shape (through the client's exception classes, and as an `error` event mid-stream), and the API key as
`x-api-key` on a keyed ring."""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import anthropic
import httpx
import openai
import pytest

from tests.server_helpers import ServerHandle, start_server

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Name three colours."}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"]}}
FORCED = {"type": "tool", "name": "get_weather"}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
KEY = "sk-test-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def client(smollm_server: ServerHandle) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smollm_server.base_url, api_key="unused", max_retries=0, timeout=120)


def greedy(client: anthropic.Anthropic, extra: dict[str, Any] | None = None, **fields: Any) -> anthropic.types.Message:
    """A message at temperature 0 (the client no longer names temperature: it goes as an extra field)."""
    return client.messages.create(model=MODEL, extra_body={"temperature": 0, **(extra or {})},
                                  **{"max_tokens": 12, "messages": ASK, **fields})


def stream_events(client: anthropic.Anthropic, **fields: Any) -> list[Any]:
    with client.messages.create(model=MODEL, extra_body={"temperature": 0}, stream=True, **fields) as stream:
        return list(stream)


def generated_tokens(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return float(re.search(r"^ringserve:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M).group(1))


def weather_input_valid(value: Any) -> bool:
    """get_weather's input_schema, checked by hand: exactly city (a short string) and unit (one of two)."""
    return (isinstance(value, dict) and set(value) == {"city", "unit"} and isinstance(value["city"], str)
            and len(value["city"]) <= 20 and value["unit"] in ("celsius", "fahrenheit"))


def test_a_message_whole_and_streamed(client: anthropic.Anthropic, smollm_server: ServerHandle) -> None:
    before = generated_tokens(smollm_server.base_url)
    reply = greedy(client)
    assert generated_tokens(smollm_server.base_url) - before == reply.usage.output_tokens  # metered like chat
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert reply.model == MODEL and [block.type for block in reply.content] == ["text"]
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    assert 0 < reply.usage.output_tokens <= 12
    events = stream_events(client, max_tokens=12, messages=ASK)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == reply.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == reply.stop_reason and delta.usage.output_tokens == reply.usage.output_tokens
    # the prompt was cached by the first request: its tokens are read from the cache, and counted apart
    start = events[0].message.usage
    assert start.cache_read_input_tokens > 0
    assert start.input_tokens + start.cache_read_input_tokens == (reply.usage.input_tokens
                                                                  + reply.usage.cache_read_input_tokens)


def test_system_and_turns_give_the_chat_completions_text(client: anthropic.Anthropic,
                                                         smollm_server: ServerHandle) -> None:
    system = "You are a pirate. Answer in one sentence."
    turns = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Arr, ahoy!"},
             {"role": "user", "content": [{"type": "text", "text": "Where is your ship?"}]}]
    reply = greedy(client, system=system, messages=turns, max_tokens=16)
    as_blocks = greedy(client, system=[{"type": "text", "text": system}], messages=turns, max_tokens=16)
    assert as_blocks.content[0].text == reply.content[0].text
    chat = openai.OpenAI(base_url=smollm_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    completion = chat.chat.completions.create(model=MODEL, temperature=0, max_tokens=16, messages=[
        {"role": "system", "content": system}, *turns])
    assert reply.content[0].text == completion.choices[0].message.content
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == completion.usage.prompt_tokens


def test_stop_sequences_and_max_tokens(client: anthropic.Anthropic) -> None:
    free = greedy(client, max_tokens=24)
    text = free.content[0].text
    sequence = text.split()[2]
    stopped = greedy(client, max_tokens=24, stop_sequences=[sequence])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == sequence
    assert stopped.content[0].text == text[:text.index(sequence)]
    cut = greedy(client, max_tokens=3, messages=[{"role": "user", "content": "Write a long story about a cat."}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_a_forced_tool_call_and_its_result(client: anthropic.Anthropic) -> None:
    reply = greedy(client, max_tokens=40, messages=WEATHER_ASK, tools=[WEATHER], tool_choice=FORCED)
    assert reply.stop_reason == "tool_use"
    [call] = [block for block in reply.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather" and weather_input_valid(call.input)
    answer = greedy(client, max_tokens=16, tools=[WEATHER], messages=[
        *WEATHER_ASK, {"role": "assistant", "content": reply.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "18 degrees, sunny"}]}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text.strip()
    # the result is in the prompt: a failed call's result too, marked as an error
    failed = greedy(client, max_tokens=1, tools=[WEATHER], messages=[
        *WEATHER_ASK, {"role": "assistant", "content": reply.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                                      "content": "18 degrees, sunny"}]}])
    assert failed.usage.input_tokens + failed.usage.cache_read_input_tokens > (
        answer.usage.input_tokens + answer.usage.cache_read_input_tokens)


def test_count_tokens_counts_the_prompt_the_message_would_send(client: anthropic.Anthropic) -> None:
    """`messages.count_tokens` gives the input tokens the same body's message reports (system, turns and the
    tools the template renders); bad input is a 400 in Anthropic's shape."""
    for fields in ({"messages": ASK}, {"messages": WEATHER_ASK, "tools": [WEATHER], "system": "Be brief."}):
        counted = client.messages.count_tokens(model=MODEL, **fields)
        sent = greedy(client, max_tokens=1, **fields).usage
        assert counted.input_tokens == sent.input_tokens + sent.cache_read_input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER])
    assert with_tools.input_tokens > client.messages.count_tokens(model=MODEL, messages=WEATHER_ASK).input_tokens
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model=MODEL, messages=ASK, extra_body={"max_tokens": 5})
    assert caught.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in str(caught.value)


def test_tool_use_streams_as_input_json(client: anthropic.Anthropic) -> None:
    fields = {"max_tokens": 40, "messages": WEATHER_ASK, "tools": [WEATHER], "tool_choice": FORCED}
    whole = greedy(client, **fields)
    events = stream_events(client, **fields)
    [start] = [e for e in events if e.type == "content_block_start"]
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    assert start.content_block.id.startswith("toolu_")
    pieces = [e.delta for e in events if e.type == "content_block_delta"]
    assert pieces and all(p.type == "input_json_delta" for p in pieces)
    streamed = json.loads("".join(p.partial_json for p in pieces))
    assert weather_input_valid(streamed) and streamed == whole.content[-1].input
    assert [e for e in events if e.type == "message_delta"][0].delta.stop_reason == "tool_use"


@pytest.mark.parametrize("fields, named", [
    ({"extra": {"temperature_schedule": 1}}, "temperature_schedule"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png",  # a 1x1 PNG, to a model without vision
        "data": "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="}}]}]},
     "images"),
    ({"thinking": {"type": "enabled"}}, "thinking"),
    ({"extra": {"top_k": "many"}}, "top_k"),
    ({"stop_sequences": [""]}, "stop_sequences"),
])
def test_bad_input_is_a_400_in_anthropic_shape(client: anthropic.Anthropic, fields: dict[str, Any],
                                               named: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        greedy(client, **fields)
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert named in body["error"]["message"]
    if named == "thinking":
        assert "budget_tokens: Field required" in body["error"]["message"]
    if named == "images":
        assert "this model takes no images" in body["error"]["message"]


def test_ring_errors_and_unknown_models_in_anthropic_shape(client: anthropic.Anthropic,
                                                           smollm_server: ServerHandle) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:  # refused by the tokenizer, not the entry
        greedy(client, max_tokens=10**6)
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in caught.value.body["error"]["message"]
    broken = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}
    with pytest.raises(anthropic.BadRequestError) as caught:  # the forced call's grammar does not compile
        greedy(client, tools=[broken], tool_choice={"type": "any"})
    assert caught.value.body["error"]["message"].startswith("tools: ")
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-opus", max_tokens=4, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"
    unknown = httpx.post(smollm_server.base_url + "/v1/messages/batches", json={}, timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


def test_an_abort_mid_stream_is_an_error_event(client: anthropic.Anthropic, smollm_server: ServerHandle) -> None:
    with client.messages.create(model=MODEL, max_tokens=400, stream=True, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": "Write a very long story about a cat."}]) as stream:
        events = iter(stream)
        start = next(events)
        aborted = httpx.post(smollm_server.base_url + "/abort_request", json={"rid": start.message.id[4:]},
                             timeout=10)
        assert aborted.status_code == 200, aborted.text
        with pytest.raises(anthropic.APIStatusError) as caught:
            for _ in events:
                pass
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "api_error"
    assert "aborted" in caught.value.body["error"]["message"]


@pytest.fixture(scope="module")
def keyed_ring(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    with mock.patch.dict(os.environ, {"RINGSERVE_API_KEY": KEY}):
        handle = start_server(str(tiny_model_dir))
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]


def test_the_key_as_x_api_key(keyed_ring: ServerHandle) -> None:
    keyed = anthropic.Anthropic(base_url=keyed_ring.base_url, api_key=None, default_headers={"x-api-key": KEY},
                                max_retries=0, timeout=120)
    model = httpx.get(keyed_ring.base_url + "/v1/models", headers={"x-api-key": KEY}, timeout=10).json()
    reply = keyed.messages.create(model=model["data"][0]["id"], max_tokens=2, messages=ASK,
                                  extra_headers={"anthropic-beta": "anything"})
    assert reply.usage.output_tokens <= 2
    for wrong in ({"x-api-key": KEY + "x"}, {"authorization": "Bearer wrong"}):
        with pytest.raises(anthropic.AuthenticationError) as caught:
            anthropic.Anthropic(base_url=keyed_ring.base_url, api_key=None, default_headers=wrong,
                                max_retries=0).messages.create(model="any", max_tokens=2, messages=ASK)
        assert caught.value.body["error"]["type"] == "authentication_error"
    refused = httpx.post(keyed_ring.base_url + "/v1/messages", json={}, timeout=10)
    assert refused.status_code == 401 and refused.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": refused.json()["error"]["message"]}}
    assert KEY not in refused.text
