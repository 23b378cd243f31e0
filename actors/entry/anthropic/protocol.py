"""Anthropic Messages bodies -> a GenerateRequest on the chat path, and ring outputs -> Messages responses, stream
events and errors in Anthropic's shapes.

A Messages body becomes the GenerateRequest a chat completion would: `system` and `messages` as ChatMessages (an
assistant's `tool_use` blocks as its tool calls, a user's `tool_result` blocks as `tool` turns; a final assistant
message is continued, Anthropic's prefill), `tools` and `tool_choice` as the chat path's ToolPlan
(`tools/request.py` `parse_tools`: rendered by the chat template, a forced call enforced by a grammar, calls read out of
the text by the entry's tool parser), `thinking` as the chat template's `enable_thinking` and the thinking token
budget (`parse_thinking`; the answer then opens with a `thinking` block: the ring's `reasoning_text`), vLLM's
`chat_template_kwargs` as the template's variables, and the sampling fields under their native names, checked by
Specs derived from `ringserve.bus.params`. An assistant's earlier `thinking` blocks reach the template as its `reasoning_content`.
Every top-level field is implemented, accepted without effect (`NO_EFFECT`), refused with its reason
(`REFUSED`), or a 400 naming it.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from ringserve.actors.entry.field_checks import Refused, check_top_level
from ringserve.actors.entry.openai.protocol import STREAM, adapter_of
from ringserve.actors.entry.template_switches import (CHAT_TEMPLATE_KWARGS, THINKING_VARIABLE, template_kwargs,
                                                      with_defaults)
from ringserve.actors.entry.tool_parsers import DEFAULT_PARSER
from ringserve.actors.entry.tools.request import NAME_PATTERN, ToolPlan, output_constraint, parse_tools
from ringserve.actors.entry.tools.response import tool_message
from ringserve.bus.errors import ApiError, clip
from ringserve.bus.messages import ChatMessage, FinishReason, GenerateRequest, RequestOutput
from ringserve.bus.param_spec import Spec
from ringserve.bus.params import SPECS

MESSAGES_PATH = "/v1/messages"
CACHE_HINT = "cache_control"  # on the body, blocks and tools: no effect, the prefix cache is automatic


def _renamed(native: str, name: str, **changes: Any) -> Spec:
    """The sampling parameter `native` of bus.params under its Messages name (errors name it so)."""
    return dataclasses.replace(SPECS[native], name=name, openai=(name,), **changes)


# Messages name -> (native name, its Spec); max_tokens is required and at least 1, as Anthropic has it
SAMPLING: dict[str, tuple[str, Spec]] = {
    "max_tokens": ("max_new_tokens", _renamed("max_new_tokens", "max_tokens", low=1, default_doc=None,
                                              doc="tokens to generate at most (required)")),
    "stop_sequences": ("stop", _renamed("stop", "stop_sequences", doc="stop strings: the text ends before the "
                                                                         "first match, reported as stop_sequence")),
    "temperature": ("temperature", _renamed("temperature", "temperature")),
    "top_p": ("top_p", _renamed("top_p", "top_p")),
    "top_k": ("top_k", _renamed("top_k", "top_k")),
}
# The fields without effect and the refused ones (docs/api.md lists both); a null value is absent
NO_EFFECT: dict[str, str] = {
    "metadata": "a user id for the provider's abuse detection",
    "service_tier": "the provider's capacity tier",
    CACHE_HINT: "a prompt-caching breakpoint: the prefix cache is automatic",
}
REFUSED: dict[str, Refused] = {
    "mcp_servers": Refused("MCP servers are not supported", ([],)),
    "container": Refused("code-execution containers are not supported"),
    "context_management": Refused("context management is not supported"),
}
THINKING = "thinking"
# thinking.budget_tokens: the request's thinking_token_budget (bus.params), under its Messages name
BUDGET = _renamed("thinking_token_budget", "thinking.budget_tokens", default_doc=None,
                  doc="the most tokens the model may think before it must answer")
DISPLAYS = (None, "summarized", "omitted")  # summarized: the thinking as it came (no summaries are written)
IMPLEMENTED = {"model", "messages", "system", "stream", "tools", "tool_choice", THINKING, CHAT_TEMPLATE_KWARGS.name,
               *SAMPLING}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Messages -> chat's; "tool" names one
_BLOCK_FIELDS = {"text": {"type", "text", "citations", CACHE_HINT},
                 "tool_use": {"type", "id", "name", "input", CACHE_HINT},
                 "tool_result": {"type", "tool_use_id", "content", "is_error", CACHE_HINT},
                 "image": {"type", "source", CACHE_HINT},
                 "thinking": {"type", "thinking", "signature", CACHE_HINT},
                 "redacted_thinking": {"type", "data", CACHE_HINT}}
# an assistant's earlier thinking: a thinking block reaches the template as the turn's reasoning_content; a
# redacted one (encrypted by Anthropic) is accepted and left out
THINKING_BLOCKS = ("thinking", "redacted_thinking")
_TOOL_FIELDS = {"type", "name", "description", "input_schema", CACHE_HINT}
ERROR_PREFIX = "Error: "  # a tool_result with is_error: true reaches the model as this, then its content


def invalid(where: str, what: str) -> ApiError:
    """A 400 about the field at `where`, a dotted path as Anthropic names fields (`messages.0.content`)."""
    return ApiError(f"{where}{what}", param=where.split(".")[0])


def extra_field(where: str) -> ApiError:
    """Anthropic's 400 for a field it does not know."""
    return invalid(where, ": Extra inputs are not permitted")


def _check_fields(body: dict[str, Any]) -> None:
    check_top_level(body, IMPLEMENTED, NO_EFFECT, REFUSED, lambda name: extra_field(clip(str(name))))


def _object(value: Any, where: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(where, " must be an object")
    unknown = next((k for k in value if k not in allowed), None)
    if unknown is not None:
        raise extra_field(f"{where}.{clip(str(unknown))}")
    cache = value.get(CACHE_HINT)
    if cache is not None and not isinstance(cache, dict):
        raise invalid(f"{where}.{CACHE_HINT}", " must be an object")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise invalid(where, " must be a string")
    return value


def _block(value: Any, where: str, allowed_types: tuple[str, ...]) -> dict[str, Any]:
    """One content block, checked: its type among `allowed_types` (others are named as not supported)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str):
        raise invalid(where, " must be a content block object with a string type")
    if kind not in allowed_types:
        scope = "here" if kind in _BLOCK_FIELDS else "by this server"
        raise invalid(where, f": {clip(kind)} blocks are not supported {scope}; this content takes "
                             f"{' and '.join(allowed_types)} blocks")
    block = _object(value, where, _BLOCK_FIELDS[kind])
    if kind == "text":
        _string(block.get("text"), f"{where}.text")
        if block.get("citations"):
            raise invalid(f"{where}.citations", ": citations are not supported")
    elif kind == "thinking":
        _string(block.get("thinking"), f"{where}.thinking")
    elif kind == "redacted_thinking":
        _string(block.get("data"), f"{where}.data")
    return block


def _texts(content: Any, where: str) -> str:
    """A string, or a list of text blocks, as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, " must be a string or a list of text blocks")
    return "".join(_block(b, f"{where}.{i}", ("text",))["text"] for i, b in enumerate(content))


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant's tool_use block as the chat path's tool call."""
    name, arguments = _string(block.get("name"), f"{where}.name"), block.get("input")
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.input", " must be an object")
    call_id = _string(block.get("id"), f"{where}.id")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _tool_turn(block: dict[str, Any], where: str, names: dict[str, str]) -> ChatMessage:
    """A user's tool_result block as a `tool` turn answering its call."""
    call_id = _string(block.get("tool_use_id"), f"{where}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else _texts(content, f"{where}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise invalid(f"{where}.is_error", " must be a boolean")
    return ChatMessage(role="tool", content=ERROR_PREFIX + text if is_error else text, tool_call_id=call_id,
                       name=names.get(call_id))


def parse_turns(system: Any, messages: Any) -> tuple[list[ChatMessage], bool]:
    """`system` and `messages` as ChatMessages, and whether the last (an assistant's text) is to be continued."""
    turns = [] if system is None else [ChatMessage(role="system", content=_texts(system, "system"))]
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    names: dict[str, str] = {}  # tool_use id -> the tool it called
    prefill = False
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        message = _object(message, where, {"role", "content"})
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise invalid(f"{where}.role", " must be user or assistant (the system prompt is the top-level system "
                                           "field)")
        last = i == len(messages) - 1
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list) or (not content and not (last and role == "assistant")):
            raise invalid(f"{where}.content", " must be a string or a non-empty list of content blocks")
        kinds = ("text", "tool_use", *THINKING_BLOCKS) if role == "assistant" else ("text", "image", "tool_result")
        blocks = [_block(b, f"{where}.content.{j}", kinds) for j, b in enumerate(content)]
        if role == "assistant":
            calls = [_tool_call(b, f"{where}.content.{j}") for j, b in enumerate(blocks) if b["type"] == "tool_use"]
            names.update((c["id"], c["function"]["name"]) for c in calls)
            text = "".join(b["text"] for b in blocks if b["type"] == "text")
            if last and not calls:
                prefill = bool(text)  # an empty final assistant turn is just the turn to open
                if not prefill:
                    break
            thinking = [b["thinking"] for b in blocks if b["type"] == "thinking"]
            turns.append(ChatMessage(role="assistant", content=text, tool_calls=calls,
                                     reasoning_content="".join(thinking) if thinking else None))
            continue
        turns += _user_turns(blocks, where, names)
    return turns, prefill


def _image_part(block: dict[str, Any], where: str) -> dict[str, str]:
    """An image block as a chat image part: its `source` (base64 with its media type, or a URL) as a URL, and where
    it was, for the 400 that a bad image gets (actors/entry/image_input.py)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        _object(source, f"{where}.source", {"type", "media_type", "data"})
        media = _string(source.get("media_type"), f"{where}.source.media_type")
        url = f"data:{media};base64,{_string(source.get('data'), f'{where}.source.data')}"
    elif kind == "url":
        _object(source, f"{where}.source", {"type", "url"})
        url = _string(source.get("url"), f"{where}.source.url")
    else:
        raise invalid(f"{where}.source", ": must be {\"type\": \"base64\", \"media_type\", \"data\"} or "
                                         "{\"type\": \"url\", \"url\"}")
    return {"type": "image", "url": url, "where": where}


def _user_turns(blocks: list[dict[str, Any]], where: str, names: dict[str, str]) -> list[ChatMessage]:
    """A user message's blocks in order: each tool result a `tool` turn, the text and images around them user
    turns (with images: their parts in order)."""
    turns: list[ChatMessage] = []
    parts: list[dict[str, str]] = []

    def user_turn() -> None:
        images = any(part["type"] == "image" for part in parts)
        text = "".join(part.get("text", "") for part in parts)
        turns.append(ChatMessage(role="user", content=text, parts=list(parts) if images else None))
        parts.clear()

    for j, block in enumerate(blocks):
        if block["type"] == "text":
            parts.append({"type": "text", "text": block["text"]})
            continue
        if block["type"] == "image":
            parts.append(_image_part(block, f"{where}.content.{j}"))
            continue
        if parts:
            user_turn()
        turns.append(_tool_turn(block, f"{where}.content.{j}", names))
    if parts:
        user_turn()
    return turns


def parse_tool_plan(body: dict[str, Any], parser: str) -> ToolPlan | None:
    """`tools` and `tool_choice` as the chat path's ToolPlan; None when the model may call no tool."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is not None and not isinstance(raw, list):
        raise ApiError("tools must be a list of tools", param="tools")
    functions = []
    for i, tool in enumerate(raw or []):
        tool = _object(tool, f"tools.{i}", _TOOL_FIELDS)
        if tool.get("type") not in (None, "custom"):
            raise ApiError(f"tools.{i}: server tools ({clip(str(tool['type']))}) are not supported; give a custom "
                           "tool's name, description and input_schema", param="tools")
        if not isinstance(tool.get("name"), str) or not NAME_PATTERN.match(tool["name"]):
            raise ApiError(f"tools.{i}.name must be 1 to 64 letters, digits, _ or -", param="tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise ApiError(f"tools.{i}.input_schema must be a JSON schema with type object", param="tools")
        function = {"name": tool["name"], "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = _string(tool["description"], f"tools.{i}.description")
        functions.append({"type": "function", "function": function})
    chat: dict[str, Any] = {"tools": functions}
    if choice is not None:
        choice = _object(choice, "tool_choice", {"type", "name", "disable_parallel_tool_use"})
        kind, parallel = choice.get("type"), choice.get("disable_parallel_tool_use")
        if kind not in (*TOOL_CHOICES, "tool") or ("name" in choice) != (kind == "tool"):
            raise ApiError("tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                           "{\"type\": \"tool\", \"name\": ...}", param="tool_choice")
        if parallel is not None and not isinstance(parallel, bool):
            raise ApiError("tool_choice.disable_parallel_tool_use must be a boolean", param="tool_choice")
        if not functions and kind != "none":
            raise ApiError(f"tool_choice {kind} needs tools", param="tool_choice")
        chat["tool_choice"] = TOOL_CHOICES.get(kind) or {"type": "function", "function": {"name": choice["name"]}}
        chat["parallel_tool_calls"] = parallel is not True
    return parse_tools(chat, parser)


def parse_thinking(value: Any) -> tuple[str | None, bool | None, int | None]:
    """The body's `thinking` config: how the answer shows the thinking ("summarized": as it came, "omitted":
    an empty thinking block; None: not at all), the template's `enable_thinking` (None: the template's
    default), and the thinking token budget.

    `{"type": "enabled", "budget_tokens": N}` turns thinking on with that budget; `{"type": "disabled"}` turns it
    off; `{"type": "adaptive"}` leaves it to the model (its template's default); absent, the template's default
    applies and the thinking is not returned (only the answer), as Anthropic's clients expect.
    """
    if value is None:
        return None, None, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise invalid(THINKING, ": must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"disabled\"} or "
                                "{\"type\": \"adaptive\"}")
    if kind == "disabled":
        _object(value, THINKING, {"type"})
        return None, False, None
    _object(value, THINKING, {"type", "display", "budget_tokens"} if kind == "enabled" else {"type", "display"})
    display = value.get("display")
    if display not in DISPLAYS:
        raise invalid(f"{THINKING}.display", ": must be summarized or omitted")
    if kind == "adaptive":
        return display or "summarized", None, None
    if value.get("budget_tokens") is None:
        raise invalid(f"{THINKING}.budget_tokens", ": Field required")
    try:
        budget = BUDGET.check(value["budget_tokens"])
    except ApiError as exc:
        exc.param = THINKING
        raise
    return display or "summarized", True, budget


def template_switches(body: dict[str, Any]) -> tuple[str | None, int | None, dict[str, Any] | None]:
    """A body's `thinking` and `chat_template_kwargs`: the thinking's display, its token budget, and the chat
    template's variables (`enable_thinking` from `thinking`, unless the kwargs set it)."""
    display, enabled, budget = parse_thinking(body.get(THINKING))
    switches = with_defaults(template_kwargs(body.get(CHAT_TEMPLATE_KWARGS.name)), **{THINKING_VARIABLE: enabled})
    return display, budget, switches


@dataclass
class MessagesOptions:
    """How the entry shapes the answer to one Messages request."""

    rid: str
    model: str
    stream: bool
    tools: ToolPlan | None
    stop_sequences: list[str]
    lora_name: str | None = None  # the LoRA adapter `model` named (`adapter_of`), checked by the route
    thinking: str | None = None  # the thinking's display (`parse_thinking`): None, "summarized" or "omitted"

    @property
    def message_id(self) -> str:
        return f"msg_{self.rid}"


def parse_body(body: dict[str, Any], rid: str, served_model: str,
               tool_parser: str = DEFAULT_PARSER) -> tuple[GenerateRequest, MessagesOptions]:
    """A Messages body as a GenerateRequest (chat messages, tools, native sampling) plus response options."""
    _check_fields(body)
    model = body.get("model")
    if model is None:
        raise ApiError("model: Field required", param="model")
    lora_name = adapter_of(model, served_model)
    if body.get("max_tokens") is None:
        raise ApiError("max_tokens: Field required", param="max_tokens")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ApiError("metadata must be an object", param="metadata")
    turns, prefill = parse_turns(body.get("system"), body.get("messages"))
    sampling = {native: spec.check(body[name]) for name, (native, spec) in SAMPLING.items()
                if body.get(name) is not None}
    tools = parse_tool_plan(body, tool_parser)
    if tools is not None and tools.choice == "auto" and tools.parser.keeps_special_tokens:
        sampling["skip_special_tokens"] = False  # the parser must see its tags
    constraint = output_constraint({}, tools)  # a forced call's schema, or auto's lazy grammar
    if constraint is not None:
        sampling[constraint[0]] = constraint[1]
    if lora_name is not None:
        sampling["lora_name"] = lora_name
    display, budget, switches = template_switches(body)
    if budget is not None:
        sampling["thinking_token_budget"] = budget
    options = MessagesOptions(rid, model, STREAM.read(body, False), tools, sampling.get("stop", []), lora_name,
                              display)
    return GenerateRequest(rid=rid, messages=turns, sampling=sampling, openai_names=True, stream=options.stream,
                           tools=tools.tools if tools else None, add_generation_prompt=not prefill,
                           continue_final_message=prefill, chat_template_kwargs=switches), options


# --- answers ----------------------------------------------------------------------------------------------------

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
    return {"id": options.message_id, "type": "message", "role": "assistant", "model": options.model,
            "content": content}


def event(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event of Anthropic's: its type on the `event:` line and in the data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


# --- errors -----------------------------------------------------------------------------------------------------

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def error_body(exc: ApiError) -> dict[str, Any]:
    """Anthropic's error body; a busy server's 503 (with Retry-After) is `overloaded_error`, other 5xx
    `api_error`. The message names the field where the error has one."""
    if exc.code == 503 and exc.retry_after is not None:
        kind = "overloaded_error"
    else:
        kind = ERROR_TYPES.get(exc.code, "api_error" if exc.code >= 500 else "invalid_request_error")
    message = exc.message
    if exc.param and not message.startswith(exc.param):
        message = f"{exc.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(exc: ApiError) -> JSONResponse:
    """The error as an HTTP response in Anthropic's shape, with the headers of the other routes' errors."""
    headers = {} if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
    if exc.code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body(exc), status_code=exc.code, headers=headers)


def error_event(exc: ApiError) -> str:
    """An error after the stream began, as Anthropic sends it: an `error` event."""
    return event("error", {"error": error_body(exc)["error"]})
