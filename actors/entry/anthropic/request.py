"""A Messages body -> the GenerateRequest a chat completion would make, and how to shape its answer.

`system` and `messages` become ChatMessages (turns.py); `tools` and `tool_choice` the chat path's ToolPlan
(`tools/request.py` `parse_tools`: rendered by the chat template, a forced call enforced by a grammar, calls read
out of the text by the entry's tool parser); `thinking` the chat template's `enable_thinking` and the thinking
token budget (`parse_thinking`; the answer then opens with a `thinking` block: the ring's `reasoning_text`);
vLLM's `chat_template_kwargs` the template's variables; and the sampling fields their native names, checked by
Specs derived from `ringserve.bus.params`. Every top-level field is implemented, accepted without effect
(`NO_EFFECT`), refused with its reason (`REFUSED`), or a 400 naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ringserve.actors.entry.anthropic.checks import CACHE_HINT, checked_object, checked_string, extra_field, invalid
from ringserve.actors.entry.anthropic.turns import parse_turns
from ringserve.actors.entry.field_checks import Refused, check_top_level
from ringserve.actors.entry.openai.protocol import STREAM, adapter_of
from ringserve.actors.entry.template_switches import (CHAT_TEMPLATE_KWARGS, THINKING_VARIABLE, template_kwargs,
                                                      with_defaults)
from ringserve.actors.entry.tool_parsers import DEFAULT_PARSER
from ringserve.actors.entry.tools.request import NAME_PATTERN, ToolPlan, output_constraint, parse_tools
from ringserve.bus.errors import ApiError, clip
from ringserve.bus.messages import GenerateRequest
from ringserve.bus.param_spec import Spec
from ringserve.bus.params import SPECS

MESSAGES_PATH = "/v1/messages"


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
_TOOL_FIELDS = {"type", "name", "description", "input_schema", CACHE_HINT}


def _check_fields(body: dict[str, Any]) -> None:
    check_top_level(body, IMPLEMENTED, NO_EFFECT, REFUSED, lambda name: extra_field(clip(str(name))))


def parse_tool_plan(body: dict[str, Any], parser: str) -> ToolPlan | None:
    """`tools` and `tool_choice` as the chat path's ToolPlan; None when the model may call no tool."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is not None and not isinstance(raw, list):
        raise ApiError("tools must be a list of tools", param="tools")
    functions = []
    for i, tool in enumerate(raw or []):
        tool = checked_object(tool, f"tools.{i}", _TOOL_FIELDS)
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
            function["description"] = checked_string(tool["description"], f"tools.{i}.description")
        functions.append({"type": "function", "function": function})
    chat: dict[str, Any] = {"tools": functions}
    if choice is not None:
        choice = checked_object(choice, "tool_choice", {"type", "name", "disable_parallel_tool_use"})
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
        checked_object(value, THINKING, {"type"})
        return None, False, None
    checked_object(value, THINKING, {"type", "display", "budget_tokens"} if kind == "enabled" else {"type", "display"})
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

