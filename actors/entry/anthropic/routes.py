"""Anthropic's Messages API, `POST /v1/messages`, on the chat path (request.py reads the body, answers.py and
errors.py shape the replies): one request on the ring, answered whole or streamed as Anthropic's events, every
failure in Anthropic's error shape (a failure after the stream began as an `error` event).

Streamed, the text settles into content blocks as it comes: the thinking (when the request asked for it) as a
`thinking` block of `thinking_delta`s closed by a `signature_delta`, text as `text_delta`s, each tool call (read
out of the answer text by the chat path's `ToolCallStream`) as a `tool_use` block whose input arrives as
`input_json_delta`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ringserve.actors.entry.anthropic.answers import (event, message_body, message_head, new_tool_use_id, ring_error,
                                                     stop_reason, thinking_block, usage)
from ringserve.actors.entry.anthropic.checks import extra_field
from ringserve.actors.entry.anthropic.errors import error_event, error_response
from ringserve.actors.entry.anthropic.request import (MESSAGES_PATH, NO_EFFECT, REFUSED, THINKING, MessagesOptions,
                                                     parse_body, parse_tool_plan, template_switches)
from ringserve.actors.entry.anthropic.turns import parse_turns
from ringserve.actors.entry.choices import ChoiceGroup
from ringserve.actors.entry.http_common import handles_errors, read_json
from ringserve.actors.entry.field_checks import check_top_level
from ringserve.actors.entry.openai.protocol import adapter_of
from ringserve.actors.entry.request_flow import ClientDisconnected, EntryService
from ringserve.actors.entry.native.tokenize import ask_tokenizer
from ringserve.actors.entry.template_switches import CHAT_TEMPLATE_KWARGS
from ringserve.actors.entry.tool_parsers import DEFAULT_PARSER
from ringserve.actors.entry.tools.response import ToolCallStream
from ringserve.bus.errors import ApiError, clip, server_error
from ringserve.bus.messages import RequestOutput
from ringserve.bus.subjects import new_rid
from ringserve.bus.tokenize_messages import TokenizeQuery

# /v1/messages/count_tokens' body: what shapes the prompt (thinking and the template's variables included)
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", THINKING, CHAT_TEMPLATE_KWARGS.name}

log = logging.getLogger("entry")
Endpoint = Callable[[Request], Awaitable[Response]]


class MessageEvents:
    """One streamed message as Anthropic's events, fed the request's outputs in order: a content block is opened
    when its first piece settles, and closed when the next one opens or the message ends."""

    def __init__(self, options: MessagesOptions) -> None:
        self.options = options
        self.tool_stream = ToolCallStream(options.tools) if options.tools is not None else None
        self.index = -1  # the open block's index
        self.open: str | None = None  # the open block's type
        self.called = False

    def start(self, first: RequestOutput) -> str:
        """`message_start`: the message without content, and the input's usage."""
        message = {**message_head(self.options, []), "stop_reason": None, "stop_sequence": None,
                   "usage": {**usage(first), "output_tokens": 0}}
        return event("message_start", {"message": message})

    def feed(self, out: RequestOutput) -> str:
        """The events one output settles; with its finish, the message's end. ApiError for an aborted request."""
        deltas: list[dict[str, Any]] = []
        if self.options.thinking and out.reasoning_text:
            deltas.append({"reasoning": out.reasoning_text})
        if self.tool_stream is None:
            deltas += [{"content": out.text}] if out.text else []
        else:
            deltas += self.tool_stream.feed(out.text)
            if out.finish is not None:
                deltas += self.tool_stream.finish(out.finish.type)[0]
        events = [e for delta in deltas for e in self._delta(delta)]
        if out.finish is not None:
            reason, sequence = stop_reason(self.options, out.finish, self.called)
            events += self._close()
            events.append(event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                  "usage": usage(out)}))
            events.append(event("message_stop", {}))
        return "".join(events)

    def _delta(self, delta: dict[str, Any]) -> list[str]:
        """The events of one chat delta (`ToolCallStream`'s: content, or a call's head, then its arguments; or
        thinking, `reasoning`)."""
        if "reasoning" in delta:
            events = [] if self.open == "thinking" else self._start_block(thinking_block(self.options, ""))
            if self.options.thinking == "omitted":
                return events
            return events + [self._piece({"type": "thinking_delta", "thinking": delta["reasoning"]})]
        if "content" in delta:
            events = [] if self.open == "text" else self._start_block({"type": "text", "text": ""})
            return events + [self._piece({"type": "text_delta", "text": delta["content"]})]
        call = delta["tool_calls"][0]
        if "id" in call:
            self.called = True
            return self._start_block({"type": "tool_use", "id": new_tool_use_id(),
                                      "name": call["function"]["name"], "input": {}})
        return [self._piece({"type": "input_json_delta", "partial_json": call["function"]["arguments"]})]

    def _start_block(self, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self.index += 1
        self.open = block["type"]
        return events + [event("content_block_start", {"index": self.index, "content_block": block})]

    def _piece(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def _close(self) -> list[str]:
        """The end of the open block: a thinking block's (empty) signature comes just before its stop, as in
        Anthropic's stream."""
        if self.open is None:
            return []
        events = [self._piece({"type": "signature_delta", "signature": ""})] if self.open == "thinking" else []
        self.open = None
        return events + [event("content_block_stop", {"index": self.index})]


async def stream_events(group: ChoiceGroup, options: MessagesOptions) -> AsyncIterator[str]:
    """The SSE stream of a message; an error (the ring's, or an abort) ends it as an `error` event."""
    events = MessageEvents(options)
    started = False
    async with contextlib.aclosing(group.merged()) as outputs:
        async for _, out in outputs:
            if not started:  # the first output never holds an error: ChoiceGroup.start raised it
                started = True
                yield events.start(out)
            if out.error is not None:
                yield error_event(out.error)
                return
            try:
                yield events.feed(out)
            except ApiError as exc:
                yield error_event(exc)
                return


def count_query(body: dict[str, Any], served_model: str, tool_parser: str) -> TokenizeQuery:
    """A `/v1/messages/count_tokens` body as the tokenizer's query: the prompt the same Messages body would
    send (system, turns, tools rendered by the chat template with the switches `thinking` and
    `chat_template_kwargs` set)."""
    check_top_level(body, COUNT_FIELDS, NO_EFFECT, REFUSED, lambda name: extra_field(clip(str(name))))
    model = body.get("model")
    if model is None:
        raise ApiError("model: Field required", param="model")
    adapter_of(model, served_model)  # an adapter tokenizes as its base model does
    turns, prefill = parse_turns(body.get("system"), body.get("messages"))
    tools = parse_tool_plan(body, tool_parser)
    return TokenizeQuery(messages=turns, tools=tools.tools if tools else None, add_generation_prompt=not prefill,
                         continue_final_message=prefill, chat_template_kwargs=template_switches(body)[2])


def anthropic_errors(endpoint: Endpoint) -> Endpoint:
    """`handles_errors`, answering in Anthropic's error shape (a client gone is still a 499)."""
    async def answered(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ApiError as exc:
            return error_response(exc)
        except (ClientDisconnected, ClientDisconnect):
            raise
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            return error_response(server_error("internal server error"))

    return handles_errors(answered)


def anthropic_routes(service: EntryService, tool_parser: str = DEFAULT_PARSER) -> list[Route]:
    """The Messages route over `service`; `tool_parser` reads the calls of `tool_choice` auto out of the text."""

    @anthropic_errors
    async def messages(request: Request) -> Response:
        body = await read_json(request)
        gen_req, options = parse_body(body, new_rid(), service.served_model, tool_parser)
        await service.require_adapter(options.lora_name, body.get("model"))
        if service.images is not None:
            await service.images.resolve_all([gen_req])
        try:
            group = await ChoiceGroup.start(service, request, [gen_req], 1)
        except ApiError as exc:
            raise ring_error(exc) from None
        if options.stream:
            return StreamingResponse(stream_events(group, options), media_type="text/event-stream")
        [outputs] = await group.collect(request)
        return JSONResponse(message_body(options, outputs))

    @anthropic_errors
    async def count_tokens(request: Request) -> Response:
        body = await read_json(request)
        query = count_query(body, service.served_model, tool_parser)
        await service.require_adapter(adapter_of(body.get("model"), service.served_model), body.get("model"))
        return JSONResponse({"input_tokens": len((await ask_tokenizer(service, query)).tokens)})

    return [Route(MESSAGES_PATH, messages, methods=["POST"]),
            Route(MESSAGES_PATH + "/count_tokens", count_tokens, methods=["POST"])]
