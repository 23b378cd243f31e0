"""A reasoning model's thinking (the ring's `RequestOutput.reasoning_text`) as each route gives it to clients, and
the template switches each chat-shaped body takes, in process: the routes' own parsing and shaping code is fed
RequestOutput sequences (thinking, then an answer or a tool call) and its answers are read with the official
`openai` and `anthropic` clients' types and stream accumulators. The end-to-end tests with a trained reasoning
model serve the same code over HTTP."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from ringserve.actors.entry.anthropic import request as anthropic_request
from ringserve.actors.entry.anthropic.answers import message_body
from ringserve.actors.entry.responses import protocol as rp
from ringserve.actors.entry.anthropic.routes import COUNT_FIELDS, MessageEvents, count_query
from ringserve.actors.entry.openai.protocol import NO_EFFECT, ROUTE_FIELDS, parse_chat, parse_completion
from ringserve.actors.entry.openai.bodies import full_response
from ringserve.actors.entry.openai.stream import StreamChunks
from ringserve.actors.entry.openapi.document import openapi_document
from ringserve.actors.entry.responses.events import OutputItems
from ringserve.actors.entry.native.tokenize import tokenize_query
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import FinishReason, RequestOutput, TokenLogprob
from ringserve.requests import chat_request
from ringserve.results import ChatResult, GenerateDelta, GenerateResult

MODEL = "tiny-reasoner"
ASK = [{"role": "user", "content": "What is 6 times 7?"}]
THINKING = ["The user wants ", "6 × 7. ", "That is 42."]
ANSWER = ["The answer ", "is 42."]
TOOLS = [{"type": "function", "function": {"name": "multiply", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
# thinking that mentions a call: it is thinking, never read for calls
THINKING_ABOUT_A_CALL = ["I could write ", CALL, " to call it."]


def outputs(thinking: list[str], answer: list[str], finish: str = "stop") -> list[RequestOutput]:
    """The outputs of one request as the detokenizer sends them: thinking deltas, then answer deltas (the
    boundary output carrying both), the last with `finish`; one token id per output."""
    pieces = [(t, "") for t in thinking[:-1]]
    if thinking and answer:
        pieces.append((thinking[-1], answer[0]))
        pieces += [("", a) for a in answer[1:]]
    else:
        pieces += [(t, "") for t in thinking[-1:]] + [("", a) for a in answer]
    return [RequestOutput(rid="r", seq=i, reasoning_text=r, text=a, token_ids=[100 + i], prompt_tokens=9,
                          completion_tokens=i + 1, finish=FinishReason(finish) if i == len(pieces) - 1 else None)
            for i, (r, a) in enumerate(pieces)]


def sse_payloads(text: str) -> list[dict[str, Any]]:
    """The JSON of every `data:` line of server-sent events."""
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def bad_request(call: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        call(*args, **kwargs)
    assert err.value.code == 400
    return err.value


# --- /v1/chat/completions ---------------------------------------------------------------------------------


def chat(**fields: Any) -> tuple[Any, Any]:
    return parse_chat({"model": MODEL, "messages": ASK, **fields}, "r", MODEL)


def test_chat_message_has_the_thinking_apart_from_the_answer() -> None:
    _, options = chat()
    body = ChatCompletion.model_validate(full_response("r", options, [outputs(THINKING, ANSWER)]))
    message = body.choices[0].message
    assert message.content == "The answer is 42."
    assert message.model_extra["reasoning_content"] == "The user wants 6 × 7. That is 42."
    assert body.choices[0].finish_reason == "stop"


def test_a_chat_cut_off_while_thinking_has_no_content() -> None:
    _, options = chat()
    body = full_response("r", options, [outputs(THINKING, [], finish="length")])
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "reasoning_content": "".join(THINKING)}
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_chat_without_thinking_is_answered_as_before() -> None:
    _, options = chat()
    body = full_response("r", options, [outputs([], ANSWER)])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "The answer is 42."}


def test_tool_calls_are_read_from_the_answer_never_from_the_thinking() -> None:
    _, options = chat(tools=TOOLS)
    body = ChatCompletion.model_validate(full_response("r", options, [outputs(THINKING_ABOUT_A_CALL, [CALL])]))
    message = body.choices[0].message
    assert [c.function.name for c in message.tool_calls] == ["multiply"]
    assert json.loads(message.tool_calls[0].function.arguments) == {"a": 6, "b": 7}
    assert message.content is None and body.choices[0].finish_reason == "tool_calls"
    assert message.model_extra["reasoning_content"] == "".join(THINKING_ABOUT_A_CALL)
    # thinking alone, however much it looks like a call, is no call
    body = full_response("r", options, [outputs(THINKING_ABOUT_A_CALL, ["No tool needed."])])
    assert "tool_calls" not in body["choices"][0]["message"] and body["choices"][0]["finish_reason"] == "stop"


def stream(options: Any, outs: list[RequestOutput]) -> list[ChatCompletionChunk]:
    chunks = StreamChunks("r", options, [0])
    raw = [chunk for out in outs for chunk in chunks.feed(0, out)]
    return [ChatCompletionChunk.model_validate(json.loads(json.dumps(chunk))) for chunk in raw]


def joined(chunks: list[ChatCompletionChunk], name: str) -> str:
    return "".join((getattr(c.choices[0].delta, name, None) or (c.choices[0].delta.model_extra or {}).get(name)
                    or "") for c in chunks if c.choices)


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "with-tools"])
def test_streamed_thinking_is_in_reasoning_content_chunks_only(tools: Any) -> None:
    _, options = chat(stream=True, tools=tools, return_token_ids=True)
    outs = outputs(THINKING, ANSWER)
    chunks = stream(options, outs)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert joined(chunks, "reasoning_content") == "".join(THINKING)
    assert joined(chunks, "content") == "".join(ANSWER)
    assert not any(piece in joined(chunks, "content") for piece in THINKING)
    reasoning_at = [i for i, c in enumerate(chunks) if (c.choices[0].delta.model_extra or {}).get("reasoning_content")]
    content_at = [i for i, c in enumerate(chunks) if c.choices[0].delta.content]
    assert max(reasoning_at) < min(content_at)  # the boundary output: its thinking's chunk, then its answer's
    # each output's token ids come once, on its first chunk
    ids = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
    assert ids == [t for out in outs for t in out.token_ids]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streamed_tool_calls_come_from_the_answer_only() -> None:
    _, options = chat(stream=True, tools=TOOLS)
    chunks = stream(options, outputs(THINKING_ABOUT_A_CALL, [CALL]))
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert [call.function.name for call in calls if call.function.name] == ["multiply"]
    assert json.loads("".join(call.function.arguments or "" for call in calls)) == {"a": 6, "b": 7}
    assert joined(chunks, "reasoning_content") == "".join(THINKING_ABOUT_A_CALL)
    assert joined(chunks, "content") == "" and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_streamed_logprobs_ride_with_the_thinking_chunk_once() -> None:
    _, options = chat(stream=True, logprobs=True)
    outs = outputs(THINKING, ANSWER)
    for out in outs:
        out.logprobs = [TokenLogprob(token_id=t, token=f"t{t}", logprob=-0.5) for t in out.token_ids]
    chunks = stream(options, outs)
    tokens = [e.token for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert tokens == [f"t{t}" for out in outs for t in out.token_ids]


def test_chat_takes_the_template_switches() -> None:
    request, _ = chat(chat_template_kwargs={"enable_thinking": False, "custom": [1]})
    assert request.chat_template_kwargs == {"enable_thinking": False, "custom": [1]}
    assert chat()[0].chat_template_kwargs is None
    assert chat(reasoning_effort="high")[0].chat_template_kwargs == {"reasoning_effort": "high"}
    request, _ = chat(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"})
    assert request.chat_template_kwargs == {"reasoning_effort": "low"}  # the explicit kwargs win
    assert chat(thinking_token_budget=16)[0].sampling["thinking_token_budget"] == 16
    assert bad_request(chat, chat_template_kwargs=["enable_thinking"]).param == "chat_template_kwargs"
    assert bad_request(chat, reasoning_effort="extreme").param == "reasoning_effort"


@pytest.mark.parametrize("field,value", [("chat_template_kwargs", {"enable_thinking": False}),
                                         ("reasoning_effort", "low"), ("thinking_token_budget", 8)])
def test_completions_refuse_the_chat_template_switches(field: str, value: Any) -> None:
    error = bad_request(parse_completion, {"model": MODEL, "prompt": "hi", field: value}, "r", MODEL)
    assert error.param == field and "chat" in error.message


def test_the_openapi_document_declares_the_switches_where_they_are_taken() -> None:
    schemas = openapi_document()["components"]["schemas"]
    taken = {"ChatCompletionRequest": ROUTE_FIELDS["chat"] | set(NO_EFFECT),
             "CompletionRequest": ROUTE_FIELDS["completion"] | set(NO_EFFECT),
             "ResponsesRequest": rp.IMPLEMENTED | set(rp.NO_EFFECT) | {"truncation"},  # its one neutral value
             "MessagesRequest": anthropic_request.IMPLEMENTED | set(anthropic_request.NO_EFFECT),
             "CountTokensRequest": COUNT_FIELDS}
    for body, fields in taken.items():  # each body's schema: exactly the fields its route reads
        assert set(schemas[body]["properties"]) == fields, body
    for body in ("ChatCompletionRequest", "ResponsesRequest", "MessagesRequest", "CountTokensRequest"):
        assert schemas[body]["properties"]["chat_template_kwargs"]["type"] == "object", body
    assert schemas["ChatCompletionRequest"]["properties"]["reasoning_effort"]["enum"] == ["low", "medium", "high"]
    assert "thinking_token_budget" in schemas["ChatCompletionRequest"]["properties"]
    completion = schemas["CompletionRequest"]["properties"]
    assert not {"chat_template_kwargs", "reasoning_effort", "thinking_token_budget"} & set(completion)
    assert schemas["ResponsesRequest"]["properties"]["reasoning"]["properties"]["effort"]["enum"][0] == "low"
    assert "thinking" in schemas["MessagesRequest"]["properties"]


# --- /v1/responses ----------------------------------------------------------------------------------------


def responses_body(**fields: Any) -> tuple[Any, rp.ResponseOptions]:
    return rp.parse_body({"model": MODEL, "input": "What is 6 times 7?", **fields}, "r", MODEL, "hermes", None)


def test_a_response_opens_with_its_reasoning_item() -> None:
    _, options = responses_body()
    items = OutputItems(options)
    for out in outputs(THINKING, ANSWER):
        items.feed(out)
    status, body = items.result()
    response = Response.model_validate({**body, "usage": None})  # the usage's shape is not this test's
    assert status == "completed" and [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "completed"
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "".join(THINKING))]
    assert response.output_text == "".join(ANSWER)


def test_a_response_cut_off_while_thinking_has_an_incomplete_reasoning_item_only() -> None:
    _, options = responses_body()
    items = OutputItems(options)
    for out in outputs(THINKING, [], finish="length"):
        items.feed(out)
    status, body = items.result()
    assert status == "incomplete" and [item["type"] for item in body["output"]] == ["reasoning"]
    assert body["output"][0]["status"] == "incomplete"


def test_a_streamed_response_sends_the_reasoning_events_before_the_message() -> None:
    _, options = responses_body(stream=True, tools=[{"type": "function", "name": "multiply",
                                                     "parameters": TOOLS[0]["function"]["parameters"]}])
    items = OutputItems(options)
    text = items.start() + "".join(items.feed(out) for out in outputs(THINKING_ABOUT_A_CALL, ["Calling.", CALL]))
    text += items.end()
    adapter = TypeAdapter(ResponseStreamEvent)
    payloads = sse_payloads(text)
    for payload in payloads:
        if payload.get("response"):  # the usage's shape is not this test's
            payload["response"]["usage"] = None
    events = [adapter.validate_python(payload) for payload in payloads]
    kinds = [event.type for event in events]
    assert kinds[:7] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] + ["response.reasoning_text.delta"] * 3
    assert kinds[7:10] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[10] == "response.output_item.added" and events[10].item.type == "message"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "".join(
        THINKING_ABOUT_A_CALL)
    # the official client's stream state assembles the same response
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    final = [e for event in events for e in state.handle_event(event) if e.type == "response.completed"]
    output = final[0].response.output
    assert [item.type for item in output] == ["reasoning", "message", "function_call"]
    assert output[0].content[0].text == "".join(THINKING_ABOUT_A_CALL) and output[2].name == "multiply"


def test_responses_take_the_reasoning_effort_and_template_kwargs() -> None:
    request, options = responses_body(reasoning={"effort": "medium", "summary": "auto"})
    assert request.chat_template_kwargs == {"reasoning_effort": "medium"}
    assert Response.model_validate(rp.response_object(options, "completed", [])).reasoning.effort == "medium"
    assert Response.model_validate(rp.response_object(responses_body()[1], "completed", [])).reasoning is None
    request, _ = responses_body(reasoning={"effort": "low"}, chat_template_kwargs={"enable_thinking": False})
    assert request.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    assert responses_body(reasoning={})[0].chat_template_kwargs is None
    assert responses_body(thinking_token_budget=8)[0].sampling["thinking_token_budget"] == 8
    assert bad_request(responses_body, reasoning={"summary": "detailed"}).param == "reasoning"
    assert bad_request(responses_body, reasoning={"effort": "xhigh"}).param == "reasoning"
    assert bad_request(responses_body, reasoning={"mode": "pro"}).param == "reasoning.mode"
    assert bad_request(responses_body, chat_template_kwargs="x").param == "chat_template_kwargs"


def test_reasoning_input_items_are_accepted_and_not_rendered() -> None:
    conversation = [{"role": "user", "content": "What is 6 times 7?"},
                    {"type": "reasoning", "id": "rs_1", "summary": [],
                     "content": [{"type": "reasoning_text", "text": "6 × 7 = 42."}]},
                    {"role": "assistant", "content": "42."},
                    {"role": "user", "content": "And 6 times 8?"}]
    request, options = responses_body(input=conversation)
    assert [(m.role, m.content) for m in request.messages] == [
        ("user", "What is 6 times 7?"), ("assistant", "42."), ("user", "And 6 times 8?")]
    assert options.items[1] == {"type": "reasoning", "id": "rs_1", "summary": [],
                                "content": [{"type": "reasoning_text", "text": "6 × 7 = 42."}]}
    bad = {"type": "reasoning", "summary": "no"}
    assert bad_request(responses_body, input=[bad]).param == "input"
    # a stored response's reasoning output continues as history (previous_response_id) without being rendered
    stored = {"history": [conversation[0]], "output": [rp.reasoning_item("completed"), {
        "type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "output_text", "text": "42."}]}]}
    request, _ = rp.parse_body({"input": "thanks"}, "r", MODEL, "hermes", rp.record(
        responses_body(input=[conversation[0]])[1], stored, None) | {"output": stored["output"]})
    assert [m.role for m in request.messages] == ["user", "assistant", "user"]


# --- /v1/messages -----------------------------------------------------------------------------------------


def messages_body(**fields: Any) -> tuple[Any, anthropic_request.MessagesOptions]:
    return anthropic_request.parse_body({"model": MODEL, "max_tokens": 64, "messages": ASK, **fields}, "r", MODEL)


def test_messages_thinking_config_sets_the_template_switch_and_budget() -> None:
    request, options = messages_body(thinking={"type": "enabled", "budget_tokens": 1024})
    assert request.chat_template_kwargs == {"enable_thinking": True}
    assert request.sampling["thinking_token_budget"] == 1024 and options.thinking == "summarized"
    request, options = messages_body(thinking={"type": "disabled"})
    assert request.chat_template_kwargs == {"enable_thinking": False} and options.thinking is None
    request, options = messages_body(thinking={"type": "adaptive"})
    assert request.chat_template_kwargs is None and options.thinking == "summarized"
    request, options = messages_body()
    assert request.chat_template_kwargs is None and options.thinking is None
    request, _ = messages_body(thinking={"type": "disabled"}, chat_template_kwargs={"enable_thinking": True})
    assert request.chat_template_kwargs == {"enable_thinking": True}  # the explicit kwargs win
    for bad in ({"type": "on"}, {"type": "enabled"}, {"type": "enabled", "budget_tokens": -1},
                {"type": "enabled", "budget_tokens": 10, "display": "full"}, {"type": "disabled", "x": 1}):
        assert bad_request(messages_body, thinking=bad).param == "thinking", bad


def test_a_message_opens_with_its_thinking_block_when_asked() -> None:
    _, options = messages_body(thinking={"type": "enabled", "budget_tokens": 1024})
    message = Message.model_validate(message_body(options, outputs(THINKING, ANSWER)))
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "".join(THINKING) and message.content[0].signature == ""
    assert message.content[1].text == "".join(ANSWER) and message.stop_reason == "end_turn"
    _, options = messages_body()  # thinking not asked for: the answer only
    body = message_body(options, outputs(THINKING, ANSWER))
    assert body["content"] == [{"type": "text", "text": "".join(ANSWER)}]
    _, options = messages_body(thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"})
    assert message_body(options, outputs(THINKING, ANSWER))["content"][0] == {
        "type": "thinking", "thinking": "", "signature": ""}


def stream_message(options: anthropic_request.MessagesOptions, outs: list[RequestOutput]) -> tuple[list[Any], Any]:
    events = MessageEvents(options)
    payloads = sse_payloads(events.start(outs[0]) + "".join(events.feed(out) for out in outs))
    snapshot, bufs = None, {}
    for payload in payloads:
        snapshot = accumulate_event(event=payload, current_snapshot=snapshot, json_bufs=bufs)
    return payloads, snapshot


def test_a_streamed_message_sends_thinking_deltas_then_the_signature() -> None:
    _, options = messages_body(thinking={"type": "enabled", "budget_tokens": 1024}, tools=[{
        "name": "multiply", "input_schema": TOOLS[0]["function"]["parameters"]}])
    payloads, message = stream_message(options, outputs(THINKING_ABOUT_A_CALL, ["Calling. ", CALL]))
    kinds = [(p["type"], (p.get("content_block") or p.get("delta") or {}).get("type")) for p in payloads]
    assert kinds[:6] == [("message_start", None), ("content_block_start", "thinking")] + [
        ("content_block_delta", "thinking_delta")] * 3 + [("content_block_delta", "signature_delta")]
    assert kinds[6] == ("content_block_stop", None) and kinds[7] == ("content_block_start", "text")
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "".join(THINKING_ABOUT_A_CALL) and message.content[0].signature == ""
    assert message.content[2].input == {"a": 6, "b": 7} and message.stop_reason == "tool_use"


def test_a_streamed_message_without_thinking_asked_has_no_thinking_block() -> None:
    _, options = messages_body()
    payloads, message = stream_message(options, outputs(THINKING, ANSWER))
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == "".join(ANSWER)
    assert not any("thinking" in json.dumps(p) for p in payloads)


def test_assistant_thinking_blocks_are_accepted_and_not_rendered() -> None:
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "6 × 7 = 42.", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "42."}]},
        {"role": "user", "content": "Thanks."}]
    request, _ = messages_body(messages=history)
    assert [(m.role, m.content) for m in request.messages] == [
        ("user", "What is 6 times 7?"), ("assistant", "42."), ("user", "Thanks.")]
    user_thinking = [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}]
    assert bad_request(messages_body, messages=user_thinking).param == "messages"


def test_count_tokens_renders_with_the_same_switches() -> None:
    body = {"model": MODEL, "messages": ASK, "thinking": {"type": "disabled"}}
    assert count_query(body, MODEL, "hermes").chat_template_kwargs == {"enable_thinking": False}
    body = {"model": MODEL, "messages": ASK, "chat_template_kwargs": {"enable_thinking": True}}
    assert count_query(body, MODEL, "hermes").chat_template_kwargs == {"enable_thinking": True}
    query = tokenize_query({"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}, MODEL)
    assert query.chat_template_kwargs == {"enable_thinking": False}
    assert bad_request(tokenize_query, {"prompt": "hi", "chat_template_kwargs": {}}, MODEL).param == \
        "chat_template_kwargs"


# --- the Python API -------------------------------------------------------------------------------------


def test_python_results_carry_the_thinking_apart() -> None:
    request, options = chat_request(ASK, "r", MODEL, None, {"reasoning_effort": "low"},
                                    chat_template_kwargs={"enable_thinking": True})
    assert request.chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}
    outs = outputs(THINKING, ANSWER)
    base = GenerateResult.from_outputs("r", outs, request.sampling)
    assert (base.text, base.reasoning_text) == ("".join(ANSWER), "".join(THINKING))
    assert base["reasoning_text"] == "".join(THINKING)
    deltas = [GenerateDelta.from_output("r", out, request.sampling) for out in outs]
    assert "".join(d.reasoning_text for d in deltas) == "".join(THINKING)
    assert "".join(d.text for d in deltas) == "".join(ANSWER)
    message = full_response("r", options, [outs])["choices"][0]["message"]
    result = ChatResult(text=message["content"], output_ids=base.output_ids, meta_info=base.meta_info,
                        reasoning_text=base.reasoning_text, message=message)
    assert result.message["reasoning_content"] == result.reasoning_text
    plain = GenerateResult.from_outputs("r", outputs([], ANSWER), request.sampling)
    assert "reasoning_text" not in plain.to_dict()
