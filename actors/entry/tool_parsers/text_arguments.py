"""Arguments written as text, one value per parameter (Qwen3-Coder's `<parameter=KEY>`, GLM-4.5's `<arg_value>`),
made JSON by the request's tool schemas, as vLLM's and SGLang's parsers of these formats do.

The templates write a string argument as it is and any other value as JSON, so a value is read back by the type
its parameter's schema gives (`type`, a list of types, the types of `anyOf`/`oneOf` options, or of `enum`/`const`
values):
- a value that decodes as JSON to a non-string of an allowed type is that value (`3` for an integer, `{"a": 1}`
  for an object; an integral number for an integer is made an integer);
- otherwise a parameter that may be a string keeps the text as it is (`007` stays `"007"`);
- otherwise `True`/`FALSE` for a boolean, `None` for null and a Python literal (`{'a': 1}`) for an object or an
  array are accepted; anything else is kept as JSON-decoded if it decodes, else as text.
Without a schema (the request's tools are not known, the tool or the parameter is not among them, or its schema
names no type) a value is JSON-decoded if it decodes, else kept as text. Nothing is ever evaluated.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from ringserve.actors.entry.tool_parsers.base import ParsedCall
from ringserve.actors.entry.tool_parsers.blocks import BlockParser

_MISSING = object()
Parameters = dict[str, dict[str, Any]]  # function name -> {parameter name -> its schema}


def tool_parameters(tools: list[dict[str, Any]]) -> Parameters:
    """The parameter schemas (`parameters.properties`) of each of a request's function tools, by name."""
    found: Parameters = {}
    for tool in tools:
        function = tool.get("function") or {}
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        found[function.get("name", "")] = properties if isinstance(properties, dict) else {}
    return found


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "unknown")


def schema_types(schema: Any) -> set[str] | None:
    """The JSON types a parameter schema allows; None when it does not say (any type)."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind):
        return set(kind)
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            found: set[str] = set()
            for option in options:
                types = schema_types(option)
                if types is None:
                    return None
                found |= types
            return found
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    return {_json_type(v) for v in values} if values else None


def _as_json(value: Any) -> Any:
    """`value` as JSON holds it (tuples as lists), or _MISSING if JSON cannot (sets, infinities, bytes)."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return _MISSING


def _decoded(text: str) -> Any:
    try:
        return _as_json(json.loads(text))
    except (ValueError, RecursionError):
        return _MISSING


def _fit(value: Any, types: set[str]) -> Any:
    """`value` if its JSON type is allowed (an integer where a number is, an integral number where an integer
    is, made an integer); else _MISSING."""
    kind = _json_type(value)
    if kind in types or (kind == "integer" and "number" in types):
        return value
    if kind == "number" and "integer" in types and value.is_integer():
        return int(value)
    return _MISSING


def _lenient(text: str, types: set[str]) -> Any:
    """What a model writes in Python's spelling: booleans in any case, None, literal dicts and lists."""
    word = text.strip().lower()
    if "boolean" in types and word in ("true", "false"):
        return word == "true"
    if "null" in types and word in ("null", "none"):
        return None
    if types & {"object", "array"}:
        try:
            value = _as_json(ast.literal_eval(text.strip()))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return _MISSING
        return _fit(value, types) if value is not _MISSING else _MISSING
    return _MISSING


def typed_value(text: str, schema: Any) -> Any:
    """One argument's text as the JSON value its parameter schema asks for (see the module's rules)."""
    types = schema_types(schema)
    decoded = _decoded(text)
    if types is None:
        return text if decoded is _MISSING else decoded
    if decoded is not _MISSING and not isinstance(decoded, str):
        fitted = _fit(decoded, types)
        if fitted is not _MISSING:
            return fitted
    if "string" in types:
        return text
    lenient = _lenient(text, types)
    if lenient is not _MISSING:
        return lenient
    return text if decoded is _MISSING else decoded


class TextArgumentsParser(BlockParser):
    """A block format whose arguments are text: it types them by the schemas of the request's tools, which
    `for_tools` gives it (the registered instance knows none)."""

    def __init__(self, parameters: Parameters | None = None) -> None:
        self.parameters: Parameters = parameters or {}

    def for_tools(self, tools: list[dict[str, Any]]) -> TextArgumentsParser:
        return type(self)(tool_parameters(tools))

    def call(self, name: str, pairs: list[tuple[str, str]]) -> ParsedCall | None:
        """The call of function `name` with these (parameter, text) pairs; None if a name is empty or a
        parameter is given twice."""
        name = name.strip()
        schemas = self.parameters.get(name, {})
        arguments: dict[str, Any] = {}
        for key, text in pairs:
            key = key.strip()
            if not key or key in arguments:
                return None
            arguments[key] = typed_value(text, schemas.get(key))
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False)) if name else None
