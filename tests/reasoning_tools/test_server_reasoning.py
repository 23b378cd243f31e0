"""A reasoning model with tools through every chat-shaped route, end to end, with the official clients.

The model is tests/trained_reasoning_model.py's tiny Qwen3 (trained once per recipe and cached), which at
temperature 0 answers its trained prompts with its trained texts exactly: thinking then an answer, a Hermes
tool call, a Qwen3-Coder XML call or JSON, and the answer alone when `enable_thinking` is false. Two rings
serve it: `thinking` with `--reasoning-parser auto` (qwen3, from the template) and the tool-call parser chosen
from the template (hermes), and `switched` with thinking off by default (`--default-chat-template-kwargs`) and
`--tool-call-parser qwen3_coder`.

Checked: the thinking split from the answer on chat completions (whole and streamed, never a tag or part of one
in the content), the Responses API (a `reasoning` item and its stream events) and the Messages API (a
`thinking` block only when the request asks for thinking); `enable_thinking` switched per request and by the
server's default; tool calls after the thinking, their streamed arguments joining to valid JSON; a JSON schema
that constrains the answer and not the thinking; a thinking budget closing the thinking early; and the model's
generation_config.json defaults applied and overridden.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from tests.server_helpers import ServerHandle, servers_side_by_side
from tests.trained_reasoning_model import (CASES, GENERATION_DEFAULTS, GREETING, GREETING_ANSWER,
                                           GREETING_THINKING, JSON_ANSWER, JSON_QUESTION, JSON_THINKING,
                                           TIME_QUESTION, TIME_THINKING, TIME_TOOL, WEATHER_QUESTION,
                                           WEATHER_THINKING, WEATHER_TOOL, load_reasoning_tokenizer, prompt_ids,
                                           reasoning_model_dir)

ASK = [{"role": "user", "content": GREETING}]
THINKING_ON = {"chat_template_kwargs": {"enable_thinking": True}}
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
LONG_ENOUGH = 64  # tokens: more than any trained text


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return reasoning_model_dir()


@pytest.fixture(scope="module")
def rings(model_dir: Path) -> Iterator[dict[str, ServerHandle]]:
    """Both rings, started at once."""
    specs = {"thinking": (str(model_dir), ["--reasoning-parser", "auto"]),
             "switched": (str(model_dir), ["--reasoning-parser", "auto", "--default-chat-template-kwargs",
                                           '{"enable_thinking": false}', "--tool-call-parser", "qwen3_coder"])}
    with servers_side_by_side(specs) as handles:
        yield handles
        for name, handle in handles.items():
            assert handle.stop() == 0, (name, handle.log()[-3000:])


@pytest.fixture(scope="module")
def thinking(rings: dict[str, ServerHandle]) -> ServerHandle:
    return rings["thinking"]


@pytest.fixture(scope="module")
def switched(rings: dict[str, ServerHandle]) -> ServerHandle:
    return rings["switched"]


def model_name(ring: ServerHandle) -> str:
    return httpx.get(ring.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def openai_client(ring: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=ring.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(ring: ServerHandle, messages: list[dict[str, Any]] = ASK, extra: dict[str, Any] | None = None,
         **fields: Any) -> Any:
    """A greedy chat completion (max_tokens LONG_ENOUGH unless given; None: leave it out)."""
    fields = {"max_tokens": LONG_ENOUGH, **fields}
    if fields["max_tokens"] is None:
        del fields["max_tokens"]
    return openai_client(ring).chat.completions.create(model=model_name(ring), messages=messages, temperature=0,
                                                       extra_body=extra, **fields)


def chat_stream(ring: ServerHandle, messages: list[dict[str, Any]] = ASK, extra: dict[str, Any] | None = None,
                **fields: Any) -> list[Any]:
    """The deltas of a streamed greedy chat completion (its chunks' first choice)."""
    chunks = openai_client(ring).chat.completions.create(
        model=model_name(ring), messages=messages, temperature=0, max_tokens=LONG_ENOUGH, stream=True,
        extra_body=extra, **fields)
    return [chunk.choices[0] for chunk in chunks if chunk.choices]


def reasoning_of(message: Any) -> str | None:
    """`reasoning_content` of a message or delta (a field the openai client keeps as an extra)."""
    return getattr(message, "reasoning_content", None)


def joined(choices: list[Any], part: str) -> str:
    """A stream's `content` or `reasoning_content` deltas, joined."""
    return "".join(getattr(choice.delta, part, None) or "" for choice in choices)


def assert_no_tag_in_deltas(choices: list[Any]) -> None:
    """No delta's content or reasoning carries a `<think>`/`</think>` marker or a piece of one (the trained
    thinking and answers have no `<` or `>` of their own)."""
    for choice in choices:
        for text in (choice.delta.content, reasoning_of(choice.delta)):
            assert text is None or ("<" not in text and ">" not in text), choice


def streamed_calls(choices: list[Any]) -> dict[int, dict[str, str]]:
    """A stream's tool calls by index: name and arguments, as the argument deltas join."""
    calls: dict[int, dict[str, str]] = {}
    for choice in choices:
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            if delta.function and delta.function.name:
                call["name"] += delta.function.name
            if delta.function and delta.function.arguments:
                call["arguments"] += delta.function.arguments
    return calls


# --- the served model ----------------------------------------------------------------------------------------


def test_the_rings_render_the_trained_prompts_and_show_the_models_defaults(thinking: ServerHandle,
                                                                          switched: ServerHandle) -> None:
    tokenizer = load_reasoning_tokenizer()
    for ring, kwargs, case in ((thinking, {}, "greeting"), (thinking, THINKING_OFF, "greeting_no_thinking"),
                               (switched, {}, "greeting_no_thinking"), (switched, THINKING_ON, "greeting")):
        tokens = httpx.post(ring.base_url + "/v1/tokenize", json={"messages": ASK, **kwargs}, timeout=30).json()
        assert tokens["tokens"] == prompt_ids(tokenizer, CASES[case]), (ring.base_url, kwargs)
    for ring in (thinking, switched):
        info = httpx.get(ring.base_url + "/get_model_info", timeout=30).json()
        assert info["reasoning_parser"] == "qwen3"
        assert info["default_sampling_params"] == GENERATION_DEFAULTS


# --- chat completions ------------------------------------------------------------------------------------------


def test_chat_splits_the_thinking_from_the_answer(thinking: ServerHandle) -> None:
    reply = chat(thinking)
    message = reply.choices[0].message
    assert reasoning_of(message) == GREETING_THINKING and message.content == GREETING_ANSWER
    assert reply.choices[0].finish_reason == "stop"


def test_chat_streams_the_thinking_apart_from_the_answer(thinking: ServerHandle) -> None:
    choices = chat_stream(thinking)
    assert joined(choices, "reasoning_content") == GREETING_THINKING
    assert joined(choices, "content") == GREETING_ANSWER
    assert_no_tag_in_deltas(choices)
    kinds = [("reasoning" if reasoning_of(c.delta) else "content") for c in choices
             if reasoning_of(c.delta) or c.delta.content]
    assert kinds == sorted(kinds, key=lambda kind: kind != "reasoning")  # all the thinking comes first
    assert choices[-1].finish_reason == "stop"


def test_a_request_cut_off_while_thinking_has_only_reasoning(thinking: ServerHandle) -> None:
    reply = chat(thinking, max_tokens=5)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
    assert reasoning_of(message) and GREETING_THINKING.startswith(reasoning_of(message))
    assert not message.content


def test_enable_thinking_false_per_request(thinking: ServerHandle) -> None:
    message = chat(thinking, extra=THINKING_OFF).choices[0].message
    assert message.content == GREETING_ANSWER and not reasoning_of(message)
    choices = chat_stream(thinking, extra=THINKING_OFF)
    assert joined(choices, "content") == GREETING_ANSWER and joined(choices, "reasoning_content") == ""


def test_the_servers_default_kwargs_and_a_requests_override(switched: ServerHandle) -> None:
    message = chat(switched).choices[0].message
    assert message.content == GREETING_ANSWER and not reasoning_of(message)
    message = chat(switched, extra=THINKING_ON).choices[0].message
    assert reasoning_of(message) == GREETING_THINKING and message.content == GREETING_ANSWER
    choices = chat_stream(switched, extra=THINKING_ON)
    assert joined(choices, "reasoning_content") == GREETING_THINKING
    assert joined(choices, "content") == GREETING_ANSWER
    assert_no_tag_in_deltas(choices)


def test_a_thinking_budget_closes_the_thinking_early(thinking: ServerHandle) -> None:
    for budget in (2, 5):
        message = chat(thinking, extra={"thinking_token_budget": budget}).choices[0].message
        reasoning = reasoning_of(message)
        assert reasoning and GREETING_THINKING.startswith(reasoning) and len(reasoning) < len(GREETING_THINKING)
        assert message.content == GREETING_ANSWER, budget
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        chat(thinking, extra={"thinking_token_budget": -1})


def test_generation_config_defaults_and_the_requests_own(thinking: ServerHandle) -> None:
    reply = chat(thinking, max_tokens=None)  # generation_config.json's max_new_tokens
    assert reply.usage.completion_tokens == GENERATION_DEFAULTS["max_new_tokens"]
    assert reply.choices[0].finish_reason == "length"
    reply = chat(thinking, max_tokens=LONG_ENOUGH)
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content == GREETING_ANSWER
    assert reply.usage.completion_tokens > GENERATION_DEFAULTS["max_new_tokens"]


# --- tool calls and schemas after the thinking -----------------------------------------------------------------


def test_a_hermes_tool_call_after_the_thinking(thinking: ServerHandle) -> None:
    ask = [{"role": "user", "content": WEATHER_QUESTION}]
    reply = chat(thinking, ask, tools=[WEATHER_TOOL])
    message = reply.choices[0].message
    assert reasoning_of(message) == WEATHER_THINKING
    assert not message.content and reply.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    choices = chat_stream(thinking, ask, tools=[WEATHER_TOOL])
    assert joined(choices, "reasoning_content") == WEATHER_THINKING and joined(choices, "content") == ""
    assert_no_tag_in_deltas([c for c in choices if not c.delta.tool_calls])
    calls = streamed_calls(choices)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]
    assert choices[-1].finish_reason == "tool_calls"


def test_a_forced_tool_call_is_forced_after_the_thinking(thinking: ServerHandle) -> None:
    """`required` (one call: parallel_tool_calls false) and a named function: their grammars (a JSON array of
    calls, the arguments object) are not the model's Hermes format, so its arguments are whatever the schema
    lets it write; its thinking stays whole."""
    ask = [{"role": "user", "content": WEATHER_QUESTION}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel in (("required", False), (named, None)):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        reply = chat(thinking, ask, tools=[WEATHER_TOOL], tool_choice=choice, **extra)
        message = reply.choices[0].message
        assert reasoning_of(message) == WEATHER_THINKING, choice
        assert reply.choices[0].finish_reason == "tool_calls" and not message.content, choice
        [call] = message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and list(arguments) == ["city"]
        assert isinstance(arguments["city"], str), choice


def test_a_qwen3_coder_xml_call_after_the_thinking(switched: ServerHandle) -> None:
    ask = [{"role": "user", "content": TIME_QUESTION}]
    reply = chat(switched, ask, extra=THINKING_ON, tools=[TIME_TOOL])
    message = reply.choices[0].message
    assert reasoning_of(message) == TIME_THINKING and not message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_time", {"city": "Tokyo"})]
    choices = chat_stream(switched, ask, extra=THINKING_ON, tools=[TIME_TOOL])
    assert joined(choices, "reasoning_content") == TIME_THINKING and joined(choices, "content") == ""
    calls = streamed_calls(choices)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {"city": "Tokyo"})]
    assert choices[-1].finish_reason == "tool_calls"


def json_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}


PLACE = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
         "required": ["city", "country"], "additionalProperties": False}
CITY_ONLY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
             "additionalProperties": False}


def test_a_json_schema_constrains_the_answer_and_not_the_thinking(thinking: ServerHandle) -> None:
    ask = [{"role": "user", "content": JSON_QUESTION}]
    # the model would write {"city": "Paris", "country": "France"}: this schema allows the city only
    message = chat(thinking, ask, response_format=json_format(CITY_ONLY)).choices[0].message
    assert reasoning_of(message) == JSON_THINKING  # were the schema applied from the first token, no thinking
    answer = json.loads(message.content)
    assert list(answer) == ["city"] and isinstance(answer["city"], str)
    choices = chat_stream(thinking, ask, response_format=json_format(PLACE))
    assert joined(choices, "reasoning_content") == JSON_THINKING
    answer = json.loads(joined(choices, "content"))
    assert list(answer) == ["city", "country"] and all(isinstance(value, str) for value in answer.values())


def test_a_schema_the_answer_meets_leaves_the_models_answer_as_it_is(thinking: ServerHandle) -> None:
    """The model writes `</think>\n\n` then its JSON, as Qwen3 does: the grammar, applied from the end of the
    thinking, must let that whitespace through, or it forces the first answer token off the model's text."""
    ask = [{"role": "user", "content": JSON_QUESTION}]
    message = chat(thinking, ask, response_format=json_format(PLACE)).choices[0].message
    assert reasoning_of(message) == JSON_THINKING
    assert json.loads(message.content) == json.loads(JSON_ANSWER)


# --- the Responses API -------------------------------------------------------------------------------------------


def test_responses_return_a_reasoning_item_and_its_events(thinking: ServerHandle, switched: ServerHandle) -> None:
    client = openai_client(thinking)
    fields = {"model": model_name(thinking), "input": GREETING, "temperature": 0, "max_output_tokens": LONG_ENOUGH}
    response = client.responses.create(**fields)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    item = response.output[0]
    assert [(part.type, part.text) for part in item.content] == [("reasoning_text", GREETING_THINKING)]
    assert response.output_text == GREETING_ANSWER and response.status == "completed"
    events = list(client.responses.create(**fields, stream=True))
    kinds = [event.type for event in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == GREETING_THINKING
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == GREETING_ANSWER
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [GREETING_THINKING]
    completed = events[-1]
    assert completed.type == "response.completed"
    assert [item.type for item in completed.response.output] == ["reasoning", "message"]
    # thinking switched off by the request, and on by the request over the server's default
    off = client.responses.create(**fields, extra_body=THINKING_OFF)
    assert [item.type for item in off.output] == ["message"] and off.output_text == GREETING_ANSWER
    on = openai_client(switched).responses.create(**{**fields, "model": model_name(switched)}, extra_body=THINKING_ON)
    assert [item.type for item in on.output] == ["reasoning", "message"] and on.output_text == GREETING_ANSWER


# --- the Messages API --------------------------------------------------------------------------------------------


def test_messages_return_a_thinking_block_when_asked(thinking: ServerHandle) -> None:
    client = anthropic.Anthropic(base_url=thinking.base_url, api_key="unused", max_retries=0, timeout=120)
    fields = {"model": model_name(thinking), "max_tokens": LONG_ENOUGH, "messages": ASK,
              "extra_body": {"temperature": 0}}
    asked = client.messages.create(**fields, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [block.type for block in asked.content] == ["thinking", "text"]
    assert asked.content[0].thinking == GREETING_THINKING and asked.content[1].text == GREETING_ANSWER
    assert asked.stop_reason == "end_turn"
    not_asked = client.messages.create(**fields)  # the model thinks, the client did not ask to see it
    assert [block.type for block in not_asked.content] == ["text"] and not_asked.content[0].text == GREETING_ANSWER
    disabled = client.messages.create(**fields, thinking={"type": "disabled"})
    assert [block.type for block in disabled.content] == ["text"] and disabled.content[0].text == GREETING_ANSWER
    assert disabled.usage.output_tokens < not_asked.usage.output_tokens  # it did not think at all
    with client.messages.stream(**fields, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == GREETING_THINKING
    assert "".join(d.text for d in deltas if d.type == "text_delta") == GREETING_ANSWER
    assert [block.type for block in final.content] == ["thinking", "text"]
    budgeted = client.messages.create(**fields, thinking={"type": "enabled", "budget_tokens": 3})
    assert [block.type for block in budgeted.content] == ["thinking", "text"]
    assert len(budgeted.content[0].thinking) < len(GREETING_THINKING)
    assert GREETING_THINKING.startswith(budgeted.content[0].thinking)
    assert budgeted.content[1].text == GREETING_ANSWER
