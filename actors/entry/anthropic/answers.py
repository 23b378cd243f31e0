"""Ring outputs -> a Messages answer in Anthropic's shapes: the whole message (thinking, text and `tool_use`
blocks), its usage and stop reason, the pieces a stream sends, and a ring error naming the body's field."""

from __future__ import annotations

import json
import secrets
from typing import Any

from ringserve.actors.entry.anthropic.request import THINKING, MessagesOptions
from ringserve.actors.entry.tools.response import tool_message
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import FinishReason, RequestOutput

# what the ring names (by OpenAI's names: a forced call's schema is response_format there), as this body names it
RING_NAMES = {"stop": "stop_sequences", "response_format": "tools", "json_schema": "tools", "structural_tag": "tools",
              "thinking_token_budget": THINKING}


def ring_error(exc: ApiError) -> ApiError:
    """A ring's error about the request, naming the field as the Messages body does."""
    if exc.param in RING_NAMES:
        exc.param = RING_NAMES[exc.param]
    return exc


def new_tool_use_id() -> str:
    """A fresh tool_use id, as Anthropic's look: `toolu_` and random characters."""
    return "toolu_" + secrets.token_hex(12)


def usage(out: RequestOutput) -> dict[str, int]:
    """Anthropic's usage: input tokens not read from the prefix cache, and those that were, apart."""
    return {"input_tokens": out.prompt_tokens - out.cached_tokens, "output_tokens": out.completion_tokens,
            "cache_read_input_tokens": out.cached_tokens}


def stop_reason(options: MessagesOptions, finish: FinishReason | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished message; an aborted one is an error."""
    if finish is None or finish.type == "abort":
        raise ApiError("the request was aborted before it finished (an operator's abort or a shutdown)", 503,
                       type="server_error")
    if finish.type == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(finish.matched, str) and finish.matched in options.stop_sequences:
        return "stop_sequence", finish.matched
    return "end_turn", None


def tool_use_block(name: str, arguments: str) -> dict[str, Any]:
    """A `tool_use` content block calling `name` with `arguments` (JSON text), under a fresh id."""
    return {"type": "tool_use", "id": new_tool_use_id(), "name": name, "input": json.loads(arguments)}


def thinking_block(options: MessagesOptions, thinking: str) -> dict[str, Any]:
    """A `thinking` content block (its text left out when the request's display is "omitted"); the signature is
    empty: the thinking is not signed (a block sent back is accepted as it is)."""
    return {"type": "thinking", "thinking": "" if options.thinking == "omitted" else thinking, "signature": ""}


def message_body(options: MessagesOptions, outputs: list[RequestOutput]) -> dict[str, Any]:
    """The non-streamed answer, from every output of the request in order: the thinking first (when the request
    asked for it and the model thought), then the text and tool calls."""
    text, last = "".join(out.text for out in outputs), outputs[-1]
    finish_type = last.finish.type if last.finish else None
    thinking = "".join(out.reasoning_text for out in outputs)
    content = [thinking_block(options, thinking)] if options.thinking and thinking else []
    calls: list[dict[str, Any]] = []
    if options.tools is not None:
        message, _ = tool_message(options.tools, text, finish_type)
        text, calls = message["content"] or "", message.get("tool_calls", [])
    if text:
        content.append({"type": "text", "text": text})
    content += [tool_use_block(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    reason, sequence = stop_reason(options, last.finish, bool(calls))
    return {**message_head(options, content), "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(last)}


def message_head(options: MessagesOptions, content: list[dict[str, Any]]) -> dict[str, Any]:
    """The fields a message opens with: its id, type, role, model and `content`."""
    return {"id": options.message_id, "type": "message", "role": "assistant", "model": options.model,
            "content": content}


def event(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event of Anthropic's: its type on the `event:` line and in the data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"

