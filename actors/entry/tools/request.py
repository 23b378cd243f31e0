"""The structured-output and tool-calling fields of OpenAI bodies: what the entry sends to the ring for them.

- `response_format` (and vLLM's `guided_json`, `guided_regex`, `guided_grammar`, `guided_choice`) become the
  native output constraint (`json_schema`, `regex` or `ebnf` in `sampling`); at most one per request. The
  tokenizer parses it; the entry names the field it came from in the 400 (`constraint_param`).
- `tools`, `tool_choice`, `parallel_tool_calls` become a `ToolPlan`: the tool definitions the tokenizer renders
  (`GenerateRequest.tools`), the constraint that enforces a `required` or named call (for `auto`, the lazy
  grammar of grammar.py), and how the response reads the calls out of the text.
- Chat `messages`, including assistant `tool_calls` and `role: "tool"` results, become `ChatMessage`s.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ringserve.actors.entry.image_input import chat_image_parts
from ringserve.actors.entry.tools.grammar import tool_call_tag
from ringserve.actors.entry.tool_parsers import DEFAULT_PARSER, ToolCallParser, get_parser
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import ChatMessage

NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function and schema names
TOOL_CHOICES = ("none", "auto", "required")
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
GUIDED_FIELDS = {  # vLLM's extra fields, SGLang's `regex` and llama.cpp's `grammar` -> the native constraint
    "guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "ebnf", "guided_choice": "ebnf",
    "regex": "regex", "grammar": "ebnf",
}
JSON_OBJECT_SCHEMA = '{"type": "object"}'
REASONING_KEYS = ("reasoning_content", "reasoning")  # an assistant message's earlier thinking


def _content_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                continue  # the message's images: image_input.chat_image_parts
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{index}].content: only text and image_url parts are supported",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(f"messages[{index}].content must be a string or a list of text and image_url parts",
                   param="messages")


def _history_call(call: Any, where: str) -> dict[str, Any]:
    """An assistant message's tool call, as OpenAI shapes it, with `arguments` a JSON text."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                       param="messages")
    if call.get("type", "function") != "function":
        raise ApiError(f"{where}.type must be \"function\"", param="messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise ApiError(f"{where}.function.arguments must be a JSON string", param="messages")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise ApiError(f"{where}.id must be a string", param="messages")
    return {"id": call_id or "", "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _history_reasoning(message: dict[str, Any], index: int) -> str | None:
    """An assistant message's earlier thinking: `reasoning_content` (vLLM's and DeepSeek's name) or `reasoning`
    (vLLM's newer one), a string; other roles' are a 400."""
    found = [key for key in REASONING_KEYS if message.get(key) is not None]
    if not found:
        return None
    value = message[found[0]]
    if message["role"] != "assistant" or not isinstance(value, str):
        raise ApiError(f"messages[{index}].{found[0]} must be a string, on an assistant message", param="messages")
    return value


def parse_messages(messages: Any) -> list[ChatMessage]:
    """Chat `messages` as ChatMessages: text content, an assistant's `tool_calls`, a tool result's
    `tool_call_id` (required on `role: "tool"`), `name` and an assistant's `reasoning_content`. The tokenizer
    checks the roles."""
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a string role", param="messages")
        turn = ChatMessage(role=message["role"], content=_content_text(message.get("content"), i),
                           parts=chat_image_parts(message.get("content"), i))
        calls = message.get("tool_calls")
        if calls is not None:
            if message["role"] != "assistant" or not isinstance(calls, list):
                raise ApiError(f"messages[{i}].tool_calls must be a list, on an assistant message", param="messages")
            turn.tool_calls = [_history_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(calls)]
        if message["role"] == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise ApiError(f"messages[{i}] (role tool) needs tool_call_id, the id of the call it answers",
                               param="messages")
            turn.tool_call_id = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            turn.name = message["name"]
        turn.reasoning_content = _history_reasoning(message, i)
        turns.append(turn)
    return turns


# --- output constraints ---------------------------------------------------------------------------------------


def _response_format(value: Any) -> str | None:
    """`response_format` as a JSON-schema constraint text (None for text)."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ApiError("response_format must be an object with a string type", param="response_format")
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra or (kind != "json_schema" and "json_schema" in value):
        raise ApiError(f"response_format: unexpected field {sorted(extra or {'json_schema'})[0]!r} for type "
                       f"{kind!r}", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind != "json_schema":
        raise ApiError(f"response_format.type {kind!r} is not one of text, json_object, json_schema",
                       param="response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError("response_format.json_schema must be an object with name and schema", param="response_format")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise ApiError(f"response_format.json_schema: unexpected field {sorted(unknown)[0]!r}", param="response_format")
    if not isinstance(spec.get("name"), str) or not NAME_PATTERN.match(spec["name"]):
        raise ApiError("response_format.json_schema.name must be 1 to 64 letters, digits, _ or -",
                       param="response_format")
    if not isinstance(spec.get("schema"), dict):
        raise ApiError("response_format.json_schema.schema must be a JSON schema object", param="response_format")
    for name, kind_ in (("strict", bool), ("description", str)):
        if spec.get(name) is not None and not isinstance(spec[name], kind_):
            raise ApiError(f"response_format.json_schema.{name} must be a {kind_.__name__}", param="response_format")
    return json.dumps(spec["schema"], ensure_ascii=False)


def _ebnf_choice(value: Any) -> str:
    """vLLM's `guided_choice` (a list of strings) as a grammar matching exactly one of them."""
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ApiError("guided_choice must be a non-empty list of non-empty strings", param="guided_choice")
    return "root ::= " + " | ".join(json.dumps(v, ensure_ascii=False) for v in value)


def _guided(name: str, value: Any) -> str:
    if name == "guided_choice":
        return _ebnf_choice(value)
    if name == "guided_json":
        if isinstance(value, dict):
            return json.dumps(value, ensure_ascii=False)
        if not isinstance(value, str):
            raise ApiError("guided_json must be a JSON schema (an object or its JSON text)", param=name)
    elif not isinstance(value, str):
        raise ApiError(f"{name} must be a string", param=name)
    return value


def output_constraint(body: dict[str, Any], tools: ToolPlan | None) -> tuple[str, str, str] | None:
    """The request's one output constraint as (native sampling name, value, the body field it came from).

    400 naming the second field when a body asks for two (response_format and guided_*, or either with a
    tool_choice that forces a call). `tool_choice: "auto"` adds its lazy grammar (`ToolPlan.lazy_constraint`)
    only when the body asks for no other constraint: it is dropped, not an error, beside one."""
    found: list[tuple[str, str, str]] = []
    if body.get("response_format") is not None:
        schema = _response_format(body["response_format"])
        if schema is not None:
            found.append(("json_schema", schema, "response_format"))
    for name, native in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((native, _guided(name, body[name]), name))
    forced = tools.constraint() if tools is not None else None
    if forced is not None:
        found.append(("json_schema", forced, "tools"))  # a bad parameters schema is the tools' fault
    lazy = tools.lazy_constraint() if tools is not None and not found else None
    if lazy is not None:  # auto's lazy grammar gives way to any constraint the body asks for
        found.append(("structural_tag", lazy, "tools"))
    if len(found) > 1:
        second = "tool_choice" if found[1][2] == "tools" else found[1][2]
        raise ApiError(f"{second} cannot be combined with {found[0][2]}: a request takes one output constraint",
                       param=second)
    return found[0] if found else None


# --- tools ---------------------------------------------------------------------------------------------------


@dataclass
class ToolPlan:
    """A chat request's tools: which it may call (`choice`: auto, required, or `function`, the named one)."""

    tools: list[dict[str, Any]]  # OpenAI's {"type": "function", "function": {...}}, checked
    choice: str = "auto"  # "auto", "required" or "function"
    function: str | None = None  # with choice "function": the one to call
    parallel: bool = True  # parallel_tool_calls: more than one call in a reply
    parser: ToolCallParser = field(default_factory=lambda: get_parser(DEFAULT_PARSER))  # for_tools(tools)

    def parameters(self, name: str) -> dict[str, Any]:
        """The parameters schema of tool `name`."""
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or EMPTY_PARAMETERS

    def constraint(self) -> str | None:
        """The JSON schema forcing the call(s): a named function's arguments object, or for `required` an array
        (one item unless parallel) of `{"name", "arguments"}` objects, one alternative per tool."""
        if self.choice == "function":
            assert self.function is not None
            return json.dumps(self.parameters(self.function), ensure_ascii=False)
        if self.choice != "required":
            return None
        defs: dict[str, Any] = {}
        options = []
        for i, tool in enumerate(self.tools):
            name = tool["function"]["name"]
            arguments = self.parameters(name)
            if _has_ref(arguments):  # its refs point at its own root: move it under the array's $defs
                defs[f"tool{i}"] = _rebase_refs(arguments, f"#/$defs/tool{i}")
                arguments = {"$ref": f"#/$defs/tool{i}"}
            options.append({"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
                            "required": ["name", "arguments"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": options[0] if len(options) == 1 else {"anyOf": options}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return json.dumps(schema, ensure_ascii=False)

    def lazy_constraint(self) -> str | None:
        """For `auto`: the structural tag that leaves text free and makes every call the model starts valid, in
        the parser's format (grammar.py); None for other choices and formats with no usable trigger."""
        if self.choice != "auto":
            return None
        return tool_call_tag(self.parser.name, [(t["function"]["name"], self.parameters(t["function"]["name"]))
                                                for t in self.tools], self.parallel)


def _has_ref(value: Any) -> bool:
    if isinstance(value, dict):
        return isinstance(value.get("$ref"), str) or any(_has_ref(v) for v in value.values())
    return isinstance(value, list) and any(_has_ref(v) for v in value)


def _rebase_refs(value: Any, base: str) -> Any:
    """`value` with every local `$ref` ("#...") made relative to `base` instead of the document root."""
    if isinstance(value, dict):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase_refs(v, base)
                for k, v in value.items()}
    return [_rebase_refs(v, base) for v in value] if isinstance(value, list) else value


def _tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ApiError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
    if set(tool) - {"type", "function"}:
        raise ApiError(f"{where}: unexpected field {sorted(set(tool) - {'type', 'function'})[0]!r}", param="tools")
    function = tool["function"]
    unknown = set(function) - FUNCTION_FIELDS
    if unknown:
        raise ApiError(f"{where}.function: unexpected field {sorted(unknown)[0]!r}", param="tools")
    if not isinstance(function.get("name"), str) or not NAME_PATTERN.match(function["name"]):
        raise ApiError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -", param="tools")
    for name, kind in (("description", str), ("parameters", dict), ("strict", bool)):
        if function.get(name) is not None and not isinstance(function[name], kind):
            raise ApiError(f"{where}.function.{name} must be {'an object' if kind is dict else 'a ' + kind.__name__}",
                           param="tools")
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def parse_tools(body: dict[str, Any], parser: str = DEFAULT_PARSER) -> ToolPlan | None:
    """The tool plan of a chat body; None when it calls no tools (no tools, or `tool_choice: "none"`)."""
    raw, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if raw is not None and not isinstance(raw, list):
        raise ApiError("tools must be a list of function tools", param="tools")
    tools = [_tool(tool, i) for i, tool in enumerate(raw or [])]
    names = [t["function"]["name"] for t in tools]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise ApiError(f"tools: the function name {duplicate!r} is given twice", param="tools")
    function = None
    if isinstance(choice, dict):
        target = choice.get("function")
        if choice.get("type") != "function" or not isinstance(target, dict) or not isinstance(target.get("name"), str):
            raise ApiError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                           "{\"name\": ...}}", param="tool_choice")
        function = target["name"]
        if function not in names:
            raise ApiError(f"tool_choice names the function {function!r}, which is not in tools", param="tool_choice")
        choice = "function"
    elif choice is not None and choice not in TOOL_CHOICES:
        raise ApiError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, not {choice!r}",
                       param="tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    return ToolPlan(tools, choice or "auto", function, parallel is not False, get_parser(parser).for_tools(tools))
