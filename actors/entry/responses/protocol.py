"""OpenAI Responses bodies (`POST /v1/responses`) -> a GenerateRequest on the chat path, and the response object.

`input` (a string, or items: messages with text content, `function_call` and `function_call_output` items;
`reasoning` items the next assistant turn's `reasoning_content`), after the conversation `previous_response_id` names, and after
`instructions` as the system turn, becomes chat messages; `reasoning.effort` and `chat_template_kwargs` the chat
template's switches (actors/entry/template_switches.py); `tools` (Responses' flat function tools) and
`tool_choice` the chat path's ToolPlan (`tools/request.py` `parse_tools`); `text.format` the output constraint chat's
`response_format` would be (`output_constraint`); the sampling fields their native names, checked
by Specs derived from `ringserve.bus.params`. Every top-level field is implemented, accepted without effect (`NO_EFFECT`), refused with
its reason (`REFUSED`, unless its value changes nothing), or a 400 naming it.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ringserve.actors.entry.field_checks import Refused, check_top_level
from ringserve.actors.entry.openai.protocol import STREAM, adapter_of
from ringserve.actors.entry.template_switches import (CHAT_TEMPLATE_KWARGS, EFFORT_VARIABLE, read_effort,
                                                      template_kwargs, with_defaults)
from ringserve.actors.entry.tools.request import ToolPlan, output_constraint, parse_tools
from ringserve.bus.errors import ApiError, clip
from ringserve.bus.messages import ChatMessage, GenerateRequest
from ringserve.bus.param_spec import Spec
from ringserve.bus.params import SPECS

RESPONSES_PATH = "/v1/responses"
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, 64-character keys, 512-character values


def _renamed(native: str, name: str, **changes: Any) -> Spec:
    return dataclasses.replace(SPECS[native], name=name, openai=(name,), **changes)


# Responses name -> (native name, its Spec)
SAMPLING: dict[str, tuple[str, Spec]] = {
    "max_output_tokens": ("max_new_tokens", _renamed("max_new_tokens", "max_output_tokens", low=1)),
    "temperature": ("temperature", _renamed("temperature", "temperature")),
    "top_p": ("top_p", _renamed("top_p", "top_p")),
    "thinking_token_budget": ("thinking_token_budget", _renamed("thinking_token_budget", "thinking_token_budget")),
}
STORE = Spec("keep the response (and the conversation leading to it) for GET, previous_response_id and cancel",
             kind="boolean", name="store")
BACKGROUND = Spec("answer at once with status queued and generate in the background (needs store)",
                  kind="boolean", name="background")
NO_EFFECT: dict[str, str] = {
    "user": "an end-user id, for the provider's abuse monitoring",
    "safety_identifier": "an end-user id, for the provider's abuse monitoring",
    "service_tier": "the provider's processing tier",
    "prompt_cache_key": "a routing hint for the provider's prompt cache (the prefix cache is automatic)",
    "stream_options": "include_obfuscation: random padding against length side channels",
}
REFUSED: dict[str, Refused] = {
    "truncation": Refused("only \"disabled\" is supported: a conversation longer than the context is a 400",
                          ("disabled",)),
    "include": Refused("no extra output data is available (logprobs, encrypted reasoning or tool results)", ([],)),
    "conversation": Refused("conversations objects are not supported: continue with previous_response_id"),
    "prompt": Refused("stored prompt templates are not supported"),
    "max_tool_calls": Refused("a limit on built-in tool calls is not supported (only function tools are)"),
    "top_logprobs": Refused("logprobs are not supported on /v1/responses", (0,)),
}
REASONING = "reasoning"  # {"effort", "summary"}: the effort reaches the chat template (`reasoning_options`)
SUMMARIES = (None, "auto")  # reasoning.summary: no summaries are written; the item carries the whole text
IMPLEMENTED = {"model", "input", "instructions", "previous_response_id", "tools", "tool_choice", "text", "stream",
               "store", "background", "metadata", "parallel_tool_calls", REASONING, CHAT_TEMPLATE_KWARGS.name,
               *SAMPLING}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def unknown_parameter(name: str) -> ApiError:
    """OpenAI's 400 on its Responses routes for a field it does not know."""
    return ApiError(f"Unknown parameter: '{clip(name)}'.", param=clip(name))


def _check_fields(body: dict[str, Any]) -> None:
    check_top_level(body, IMPLEMENTED, NO_EFFECT, REFUSED, unknown_parameter)


def _image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An `input_image` part, checked: `image_url` (a data URL; file and http(s) URLs where the server allows them,
    docs/api.md "Images"), `detail` only auto."""
    unknown = set(part) - {"type", "image_url", "detail", "file_id"}
    if unknown:
        raise ApiError(f"{where}: unexpected field {clip(sorted(unknown)[0])!r}", param="input")
    if part.get("file_id") is not None:
        raise ApiError(f"{where}.file_id: uploaded files are not supported; give the image as image_url",
                       param="input")
    if not isinstance(part.get("image_url"), str):
        raise ApiError(f"{where}.image_url must be a string (a data URL)", param="input")
    if part.get("detail") not in (None, "auto"):
        raise ApiError(f"{where}.detail {clip(str(part['detail']))!r} is not supported: the model's own processor "
                       "sets the resolution (only \"auto\")", param="input")
    return {"type": "input_image", "image_url": part["image_url"], "detail": "auto"}


def _parts(content: Any, where: str, role: str) -> list[dict[str, Any]]:
    """A message's content as normalized parts: its text joined into one part, or with images (input roles only)
    the text and image parts in order."""
    if role == "assistant" or not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return [{"type": "output_text" if role == "assistant" else "input_text", "text": _text(content, where)}]
    return [_image(part, f"{where}[{j}]") if isinstance(part, dict) and part.get("type") == "input_image"
            else {"type": "input_text", "text": _text([part], f"{where}[{j}]")} for j, part in enumerate(content)]


def _text(content: Any, where: str) -> str:
    """A message's content (a string or a list of text parts) as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(f"{where} must be a string or a list of input_text parts", param="input")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise ApiError(f"{where}[{j}]: only input_text and output_text parts are supported"
                           + (f", not {clip(str(kind))}" if kind else ""), param="input")
        texts.append(part["text"])
    return "".join(texts)


def _reasoning_texts(parts: Any, kind: str, where: str) -> list[dict[str, str]]:
    """A reasoning item's `summary` or `content`: a list of `{"type": kind, "text"}` parts."""
    if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == kind and set(p) <= {
            "type", "text"} and isinstance(p.get("text"), str) for p in parts):
        raise ApiError(f"{where} must be a list of {{\"type\": \"{kind}\", \"text\"}} parts", param="input")
    return [{"type": kind, "text": p["text"]} for p in parts]


def reasoning_input(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A `reasoning` input item (a client sending back a previous output), checked and normalized. Its content
    reaches the chat template as the `reasoning_content` of the assistant turn after it (`chat_turns`)."""
    unknown = next((k for k in item if k not in ("type", "id", "summary", "content", "encrypted_content",
                                                  "status")), None)
    if unknown is not None:
        raise ApiError(f"{where}: unexpected field {clip(str(unknown))!r}", param="input")
    if item.get("encrypted_content") is not None:
        raise ApiError(f"{where}.encrypted_content: encrypted reasoning is not supported (this server returns the "
                       "reasoning text as content)", param="input")
    content = item.get("content")
    return {"type": "reasoning", "id": item.get("id") or new_item_id("rs"),
            "summary": _reasoning_texts(item.get("summary"), "summary_text", f"{where}.summary"),
            "content": [] if content is None else _reasoning_texts(content, "reasoning_text", f"{where}.content")}


def reasoning_options(value: Any) -> tuple[str | None, dict[str, Any] | None]:
    """The body's `reasoning` object: the effort for the chat template, and the object the response repeats
    (None when absent). `summary` (or the deprecated `generate_summary`) may be null or auto: the reasoning
    item carries the whole thinking as `content`, with no summary (`summary: []`)."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise ApiError("reasoning must be an object", param=REASONING)
    unknown = next((k for k in value if k not in ("effort", "summary", "generate_summary")), None)
    if unknown is not None:
        raise unknown_parameter(f"{REASONING}.{unknown}")
    effort = read_effort(value.get("effort"), f"{REASONING}.effort")
    for name in ("summary", "generate_summary"):
        if value.get(name) not in SUMMARIES:
            raise ApiError(f"{REASONING}.{name} {clip(str(value[name]))!r} is not supported: reasoning summaries are "
                           "not written (only null or auto; the reasoning item's content has the whole thinking)",
                           param=REASONING)
    return effort, {"effort": effort, "summary": value.get("summary") or value.get("generate_summary")}


def check_items(value: Any, where: str = "input") -> list[dict[str, Any]]:
    """`input` as a list of normalized items (a string is one user message); 400 naming the bad item."""
    if isinstance(value, str):
        return [{"type": "message", "id": new_item_id("msg"), "role": "user",
                 "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list):
        raise ApiError(f"{where} must be a string or a list of input items", param="input")
    items = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise ApiError(f"{at}.role must be one of {', '.join(ROLES)}", param="input")
            items.append({"type": "message", "id": item.get("id") or new_item_id("msg"), "role": role,
                          "content": _parts(item.get("content"), f"{at}.content", role)})
        elif kind == "function_call":
            fields = {name: item.get(name) for name in ("call_id", "name", "arguments")}
            bad = next((name for name, v in fields.items() if not isinstance(v, str)), None)
            if bad is not None:
                raise ApiError(f"{at}.{bad} must be a string", param="input")
            items.append({"type": "function_call", "id": item.get("id") or new_item_id("fc"), **fields})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise ApiError(f"{at}.call_id must be a string", param="input")
            items.append({"type": "function_call_output", "id": item.get("id") or new_item_id("fco"),
                          "call_id": item["call_id"],
                          "output": _text(output, f"{at}.output")})
        elif kind == "reasoning":
            items.append(reasoning_input(item, at))
        else:
            raise ApiError(f"{at}: items of type {clip(str(kind))} are not supported (message, function_call, "
                           "function_call_output and reasoning are)", param="input")
    return items


def chat_turns(instructions: str | None, items: list[dict[str, Any]]) -> list[ChatMessage]:
    """Normalized items (a conversation) as chat messages: consecutive function calls join the assistant turn
    before them, each output a `tool` turn."""
    turns = [ChatMessage(role="system", content=instructions)] if instructions else []
    names: dict[str, str] = {}
    thinking: list[str] = []  # reasoning items not yet given to the assistant turn they come before
    for item in items:
        if item["type"] == "message":
            content = item["content"]
            text = "".join(p.get("text", "") for p in content)
            parts = [{"type": "image", "url": p["image_url"], "where": f"input item {item['id']} content[{j}]"}
                     if p["type"] == "input_image" else {"type": "text", "text": p["text"]}
                     for j, p in enumerate(content)] if any(p["type"] == "input_image" for p in content) else None
            turns.append(ChatMessage(role=ROLES[item["role"]], content=text, parts=parts))
        elif item["type"] == "reasoning":
            thinking += [part["text"] for part in item["content"]]
            continue
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            names[item["call_id"]] = item["name"]
            if turns and turns[-1].role == "assistant" and not thinking:
                turns[-1].tool_calls = [*(turns[-1].tool_calls or []), call]
            else:
                turns.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        else:
            turns.append(ChatMessage(role="tool", content=item["output"], tool_call_id=item["call_id"],
                                     name=names.get(item["call_id"])))
        if thinking and turns and turns[-1].role == "assistant":  # the thinking behind this assistant turn
            turns[-1].reasoning_content, thinking = "".join(thinking), []
    return turns


def _tools(body: dict[str, Any], parser: str) -> ToolPlan | None:
    """Responses' flat function tools and tool_choice, as chat's ToolPlan."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is not None and not isinstance(raw, list):
        raise ApiError("tools must be a list of function tools", param="tools")
    tools = []
    for i, tool in enumerate(raw or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(f"tools[{i}]: only function tools are supported, not {clip(str(kind))}", param="tools")
        tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                           param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return parse_tools({"tools": tools, "tool_choice": choice, "parallel_tool_calls": body.get("parallel_tool_calls")},
                       parser)


def _text_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as chat's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise ApiError("text must be an object with format", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise ApiError("text.verbosity: only medium is supported", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ApiError("text.format must be an object with a string type", param="text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"], **{k: v for k, v in fmt.items() if k != "type"}}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


@dataclass
class ResponseOptions:
    """One /v1/responses request, as the entry answers and stores it."""

    id: str
    rid: str
    model: str
    stream: bool
    store: bool
    background: bool
    tools: ToolPlan | None
    items: list[dict[str, Any]]  # this request's input items
    history: list[dict[str, Any]]  # the conversation before them (previous_response_id's)
    echo: dict[str, Any] = field(default_factory=dict)  # the request fields the response object repeats
    created_at: int = field(default_factory=lambda: int(time.time()))
    lora_name: str | None = None  # the LoRA adapter `model` named (`adapter_of`), checked by the route


def parse_body(body: dict[str, Any], rid: str, served_model: str, parser: str,
               previous: dict[str, Any] | None) -> tuple[GenerateRequest, ResponseOptions]:
    """A Responses body (and the stored record `previous_response_id` named, if any) as a GenerateRequest."""
    _check_fields(body)
    model = body.get("model")
    lora_name = adapter_of(model, served_model)
    if body.get("input") is None:
        raise ApiError("Missing required parameter: 'input'.", param="input")
    items = check_items(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError("instructions must be a string", param="instructions")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())):
        raise ApiError("metadata must be at most 16 string pairs (keys up to 64, values up to 512 characters)",
                       param="metadata")
    history = (previous["history"] + previous["output"]) if previous else []
    sampling = {native: spec.check(body[name]) for name, (native, spec) in SAMPLING.items()
                if body.get(name) is not None}
    tools = _tools(body, parser)
    if tools is not None and tools.choice == "auto" and tools.parser.keeps_special_tokens:
        sampling["skip_special_tokens"] = False  # the parser must see its tags
    try:
        constraint = output_constraint({"response_format": _text_format(body.get("text"))}, tools)
    except ApiError as exc:  # chat's words for the constraint, as this body names it
        exc.param = "tool_choice" if exc.param == "tool_choice" else "text"
        exc.message = exc.message.replace("response_format.json_schema", "text.format").replace(
            "response_format", "text.format")
        raise
    if constraint is not None:
        sampling[constraint[0]] = constraint[1]
    effort, reasoning = reasoning_options(body.get(REASONING))
    switches = with_defaults(template_kwargs(body.get(CHAT_TEMPLATE_KWARGS.name)), **{EFFORT_VARIABLE: effort})
    store, background = STORE.read(body, True), BACKGROUND.read(body, False)
    stream = STREAM.read(body, False)
    if background and not store:
        raise ApiError("background responses must be stored: background needs store true", param="background")
    echo = {"instructions": instructions, "metadata": metadata or {},
            "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0), "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
            "tools": body.get("tools") or [], "text": body.get("text") or {"format": {"type": "text"}},
            "truncation": "disabled", "user": body.get("user"), "store": store, "background": background,
            "reasoning": reasoning}
    if lora_name is not None:
        sampling["lora_name"] = lora_name
    options = ResponseOptions(f"resp_{rid}", rid, model if lora_name else served_model, stream, store, background,
                              tools, items, history, echo, lora_name=lora_name)
    gen_req = GenerateRequest(rid=rid, messages=chat_turns(instructions, history + items), sampling=sampling,
                              openai_names=True, stream=stream, tools=tools.tools if tools else None,
                              chat_template_kwargs=switches)
    return gen_req, options


def response_object(options: ResponseOptions, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None = None, incomplete: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response object as OpenAI shapes it."""
    return {"id": options.id, "object": "response", "created_at": options.created_at, "status": status,
            "model": options.model, "output": output, "usage": usage, "incomplete_details": incomplete,
            "error": error, **options.echo}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def record(options: ResponseOptions, body: dict[str, Any], owner: str | None) -> dict[str, Any]:
    """What the store keeps of a response: the object, the conversation before its output, its owner's key
    hash and its rid (so any entry can cancel it)."""
    return {**body, "history": options.history + options.items, "input_items": options.items, "owner": owner,
            "rid": options.rid}


PRIVATE_FIELDS = ("history", "input_items", "owner", "rid")


def public(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored record as the response object."""
    return {k: v for k, v in stored.items() if k not in PRIVATE_FIELDS}


def reasoning_item(status: str) -> dict[str, Any]:
    """A new `reasoning` output item as OpenAI's client types it: no summary; the thinking goes into `content` as
    one `reasoning_text` part (events.py)."""
    return {"type": "reasoning", "id": new_item_id("rs"), "summary": [], "content": [], "status": status}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": new_item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
