"""Reading a structural tag (xgrammar's `{"type": "structural_tag", "format": {...}}` JSON) before it is compiled.

The backend needs two things of a tag that xgrammar does not check: the JSON schemas inside it (each is checked
for required recursion, as a `json_schema` constraint is: the forced text inside a tag would never end) and its
literal texts (triggers, tag begins and ends, separators, constant strings), which must not hold a special
token of the model: the backend's vocabulary blanks special tokens, so a tag whose trigger is one (Mistral's
`[TOOL_CALLS]`) could never be entered, and the model could no longer write its tag at all.

Torch-free and xgrammar-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

# per format type: its fields holding literal text (a string or a list of strings)
_LITERALS = {"const_string": ("value",), "tag": ("begin", "end"), "triggered_tags": ("triggers",),
             "tags_with_separator": ("separator",)}
_SCHEMA_TYPES = ("json_schema", "qwen_xml_parameter")


def parse_tag(source: str) -> Any:
    """The decoded tag; ValueError (with Python's message) when `source` is not JSON."""
    return json.loads(source)


def _formats(node: Any) -> Iterator[dict[str, Any]]:
    """Every format object in the tag (never looking inside a JSON schema)."""
    if isinstance(node, list):
        for item in node:
            yield from _formats(item)
    elif isinstance(node, dict):
        if isinstance(node.get("type"), str):
            yield node
        for key, value in node.items():
            if key != "json_schema" or node.get("type") not in _SCHEMA_TYPES:
                yield from _formats(value)


def schemas(tag: Any) -> list[Any]:
    """The JSON schemas the tag's `json_schema` formats constrain content to."""
    return [f["json_schema"] for f in _formats(tag) if f["type"] in _SCHEMA_TYPES and "json_schema" in f]


def literals(tag: Any) -> list[str]:
    """The literal texts of the tag: triggers, tag begins and ends, separators, constant strings, dispatch
    patterns."""
    found: list[str] = []
    for fmt in _formats(tag):
        values: list[Any] = [fmt.get(name) for name in _LITERALS.get(fmt["type"], ())]
        if fmt["type"] == "dispatch" and isinstance(fmt.get("rules"), list):
            values += [rule[0] for rule in fmt["rules"] if isinstance(rule, list) and rule]
        for value in values:
            if isinstance(value, str):
                found.append(value)
            elif isinstance(value, list):
                found += [v for v in value if isinstance(v, str)]
    return found


def special_literal(tag: Any, special_tokens: Iterable[str]) -> tuple[str, str] | None:
    """The first (literal, special token) where one of the tag's literal texts holds a special token's text."""
    specials = [s for s in special_tokens if s]
    for text in literals(tag):
        for special in specials:
            if special in text:
                return text, special
    return None
