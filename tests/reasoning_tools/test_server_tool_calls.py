"""Tool calling: the parsers and the default tool prompt on fixed inputs, then the real ring with the OpenAI
client: `required` and named calls (enforced by a grammar, so they always parse and validate), `auto` with a
Hermes-formatted output read back into `tool_calls` (the output is pinned with a regex, since a 135M model
rarely calls on its own), streamed and not, a tool-result round trip, and `tool_choice: "none"`."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from ringserve.actors.entry.tool_parsers import HermesParser, Llama3JsonParser, ParsedCall
from ringserve.actors.entry.tools.request import parse_tools
from ringserve.actors.entry.tools.response import ToolCallStream, tool_message
from ringserve.actors.tokenizer.prompt import PromptEncoder, template_uses_tools
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import ChatMessage, GenerateRequest
from tests.server_helpers import ServerHandle, sse_events

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                         "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def weather_arguments_valid(arguments: str) -> bool:
    """get_weather's schema, checked by hand: exactly city (a short string) and unit (one of two)."""
    value = json.loads(arguments)
    return (isinstance(value, dict) and set(value) == {"city", "unit"} and isinstance(value["city"], str)
            and len(value["city"]) <= 20 and value["unit"] in ("celsius", "fahrenheit"))


def call_valid(call: dict[str, Any]) -> bool:
    """A `tool_calls` entry of the response, valid under the tool it names."""
    ok = call["id"].startswith("call_") and call["type"] == "function"
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    if name == "get_time":
        return ok and json.loads(arguments) == {}
    return ok and name == "get_weather" and weather_arguments_valid(arguments)


# --- units: parsers, streaming, prompt ---------------------------------------------------------------------------


def test_hermes_parser_reads_calls_and_keeps_the_rest_as_content() -> None:
    parser = HermesParser()
    items = parser.parse(f"Let me look.\n{HERMES_CALL}\n<tool_call>{{\"name\": \"get_time\"}}</tool_call>")
    assert items == ["Let me look.\n", ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}'), "\n",
                     ParsedCall("get_time", "{}")]
    assert parser.parse("<tool_call>not json</tool_call> done") == ["<tool_call>not json</tool_call>", " done"]
    assert parser.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}') == [ParsedCall("f", '{"a": 1}')]
    assert parser.parse("no calls <tool") == ["no calls <tool"]
    assert parser.consume("text <tool_c", final=False) == (["text "], 5)  # may be a call: held
    assert parser.consume(f"a {HERMES_CALL[:30]}", final=False) == (["a "], 2)


def test_llama3_json_parser() -> None:
    parser = Llama3JsonParser()
    assert parser.parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}') == [
        ParsedCall("f", '{"x": 1}'), ParsedCall("g", "{}")]
    assert parser.parse("Hello there") == ["Hello there"]
    assert parser.parse('{"not": "a call"}') == ['{"not": "a call"}']
    assert parser.consume('{"name"', final=False) == ([], 0)


def test_streamed_deltas_match_the_whole_message() -> None:
    plan = parse_tools({"tools": TOOLS})
    assert plan is not None
    text = f"Sure.\n{HERMES_CALL}\n"
    deltas: list[dict[str, Any]] = []
    stream = ToolCallStream(plan)
    for char in text:  # the worst split: one character at a time
        deltas += stream.feed(char)
    tail, finish = stream.finish("stop")
    deltas += tail
    assert finish == "tool_calls"
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["index"] == 0
    assert "id" not in calls[1] and weather_arguments_valid(calls[1]["function"]["arguments"])
    message, finish = tool_message(plan, text, "stop")
    assert message["content"] == "Sure." and finish == "tool_calls"
    assert message["tool_calls"][0]["function"]["arguments"] == calls[1]["function"]["arguments"]
    assert tool_message(plan, "Just text", "stop") == ({"role": "assistant", "content": "Just text"}, "stop")


def test_tool_fields_are_checked() -> None:
    for body, param in [({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
                        ({"tools": [WEATHER, WEATHER]}, "tools"),
                        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls")]:
        with pytest.raises(ApiError) as err:
            parse_tools(body)
        assert err.value.param == param, body
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}) is None
    schema = json.loads(parse_tools({"tools": TOOLS, "tool_choice": "required",
                                     "parallel_tool_calls": False}).constraint())
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.common.text_tokenizer import load_text_model

    return load_text_model(resolve_model(MODEL)).tokenizer  # the tokenizer actor's


HISTORY = [ChatMessage("user", "Weather in Paris?"),
           ChatMessage("assistant", "", tool_calls=[{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]),
           ChatMessage("tool", "18 degrees", tool_call_id="call_1")]


def test_default_tool_prompt_for_a_template_without_tools(tokenizer: Any) -> None:
    encoder = PromptEncoder(tokenizer)
    assert not encoder.template_tools  # SmolLM2's template does not mention tools
    text = tokenizer.decode(encoder.encode(GenerateRequest(rid="r", messages=HISTORY, tools=TOOLS)))
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n<tool_response>\n18 degrees\n</tool_response>" in text
    with pytest.raises(ApiError) as err:
        encoder.encode(GenerateRequest(rid="r", text="hi", tools=TOOLS))
    assert err.value.param == "tools"


def test_a_template_that_knows_tools_gets_them(tokenizer: Any) -> None:
    template = ("{% for t in tools or [] %}[TOOL {{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}(call {{ c.function.name }} "
                "{{ c.function.arguments.city }}){% endfor %}{% if m.tool_call_id %}[for {{ m.tool_call_id }}]"
                "{% endif %}{% endfor %}")
    assert template_uses_tools(template) and not template_uses_tools(tokenizer.chat_template)
    original = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        encoder = PromptEncoder(tokenizer)
        text = tokenizer.decode(encoder.encode(GenerateRequest(rid="r", messages=HISTORY, tools=TOOLS,
                                                               add_generation_prompt=False)))
    finally:
        tokenizer.chat_template = original
    assert text == ("[TOOL get_weather][TOOL get_time]<user>Weather in Paris?<assistant>(call get_weather Paris)"
                    "<tool>18 degrees[for call_1]")


# --- the real ring -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(smollm_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def post(server: ServerHandle, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + CHAT, json={"messages": ASK, "max_tokens": 40, **body}, timeout=120)


def streamed(server: ServerHandle, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]], str]:
    """A streamed reply put back together: its content, its tool calls (fragments joined), its finish reason."""
    with httpx.stream("POST", server.base_url + CHAT, timeout=120, json={
            "messages": ASK, "max_tokens": 40, "stream": True, **body}) as response:
        assert response.status_code == 200, response.read()
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    content, calls, finish = "", {}, None
    for event in events[:-1]:
        [choice] = event["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for part in delta.get("tool_calls", []):
            if "id" in part:  # the first chunk of a call: id, type and name
                assert part["function"]["arguments"] == "" and part["index"] == len(calls)
                calls[part["index"]] = {"id": part["id"], "type": part["type"], "function": dict(part["function"])}
            else:
                calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_required_tool_call_with_the_openai_client(client: openai.OpenAI) -> None:
    for seed in range(3):  # one call each (sampled, a model may go on calling), so 40 tokens always suffice
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=40, temperature=1.0, seed=seed)
        [choice] = reply.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls
        assert call_valid(call.model_dump())
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=64, temperature=0)
    assert reply.choices[0].finish_reason == "tool_calls", reply
    assert all(call_valid(call.model_dump()) for call in reply.choices[0].message.tool_calls)


def test_named_tool_call_streamed_and_not(smollm_server: ServerHandle) -> None:
    response = post(smollm_server, {"tools": TOOLS, "tool_choice": NAMED, "temperature": 0})
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    [call] = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call_valid(call) and call["function"]["name"] == "get_weather"
    content, calls, finish = streamed(smollm_server, {"tools": TOOLS, "tool_choice": NAMED, "temperature": 0})
    assert content == "" and finish == "tool_calls" and len(calls) == 1
    assert calls[0]["function"] == call["function"] and call_valid(calls[0])
    content, calls, finish = streamed(smollm_server, {"tools": TOOLS, "tool_choice": "required", "temperature": 0})
    assert finish == "tool_calls" and calls and all(call_valid(c) for c in calls)


def test_auto_reads_a_hermes_formatted_output(smollm_server: ServerHandle) -> None:
    # the output is pinned to a Hermes call with a regex, so what is tested is deterministic: the parsing
    pinned = {"tools": TOOLS, "tool_choice": "auto", "temperature": 0, "max_tokens": 48,
              "guided_regex": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
                              r'"unit": "celsius"\}\}\n</tool_call>'}
    response = post(smollm_server, pinned)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call_valid(call)
    content, calls, finish = streamed(smollm_server, pinned)
    assert (content, finish) == ("", "tool_calls") and [c["function"] for c in calls] == [call["function"]]
    free = post(smollm_server, {"tools": TOOLS, "temperature": 0, "max_tokens": 16})  # auto is the default
    assert free.status_code == 200, free.text
    message = free.json()["choices"][0]["message"]
    assert all(call_valid(c) for c in message.get("tool_calls") or [])


def test_tool_result_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=40, temperature=0)
    message = first.choices[0].message
    history = [*ASK, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"temperature": 18}'}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError) as err:  # a tool result must say which call it answers
        client.chat.completions.create(model=MODEL, messages=[*ASK, {"role": "tool", "content": "18"}], max_tokens=1)
    assert err.value.body["param"] == "messages"


def test_tool_choice_none_renders_no_tools(smollm_server: ServerHandle) -> None:
    plain = post(smollm_server, {"max_tokens": 4, "temperature": 0}).json()
    none = post(smollm_server, {"tools": TOOLS, "tool_choice": "none", "max_tokens": 4, "temperature": 0}).json()
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert none["choices"][0]["message"] == plain["choices"][0]["message"]
    assert "tool_calls" not in none["choices"][0]["message"]


def test_bad_tool_schema_of_a_forced_call_names_tools(smollm_server: ServerHandle) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}
    response = post(smollm_server, {"tools": [bad], "tool_choice": "required", "max_tokens": 4})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text
    response = post(smollm_server, {"tools": TOOLS, "tool_choice": "required", "max_tokens": 4,
                                    "response_format": {"type": "json_object"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice", response.text
    assert post(smollm_server, {"max_tokens": 2}).status_code == 200
