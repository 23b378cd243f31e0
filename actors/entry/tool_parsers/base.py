"""What every tool-call parser shares: the parsed call, the `consume(buffer, final)` contract, the binding of a
parser to one request's tools (`for_tools`), and the helpers that read a call out of decoded JSON and hold back
text that may become a marker."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence, Union


@dataclass(frozen=True)
class ParsedCall:
    """One tool call found in the output: the function's name and its arguments as a JSON text."""

    name: str
    arguments: str


Item = Union[str, ParsedCall]  # content text, or a call


def call_from_json(value: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """A call from a decoded `{"name": str, "arguments": object}` (or `parameters`), None for anything else.

    Arguments given as a JSON string holding an object are accepted too (some models double-encode them).
    """
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments: Any = next((value[key] for key in argument_keys if key in value), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def json_list_calls(text: str) -> list[ParsedCall] | None:
    """The calls of a text that is exactly one non-empty JSON list of call objects (blank around it), else None."""
    try:
        values, end = json.JSONDecoder().raw_decode(text.strip())
    except ValueError:
        return None
    if end != len(text.strip()) or not isinstance(values, list) or not values:
        return None
    calls = [call_from_json(v) for v in values]
    return None if None in calls else calls  # type: ignore[return-value]


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker` (may become it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def held_back(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of `text` that may become one of `markers`."""
    return max((partial_suffix(text, marker) for marker in markers), default=0)


def content_or_calls(buffer: str, calls: list[ParsedCall] | None) -> tuple[list[Item], int]:
    """A whole output settled: its calls, or (none found) the output as content."""
    return (list(calls) if calls else [buffer] if buffer else []), len(buffer)


class ToolCallParser(ABC):
    """Finds tool calls in generated text; stateless. The registered instance (`PARSERS`) serves every request;
    `for_tools` gives the one a request uses."""

    name: str = ""
    # whether the format's tags are special tokens the detokenizer must keep (a request with tools then decodes
    # with skip_special_tokens false unless it says otherwise)
    keeps_special_tokens: bool = False

    @abstractmethod
    def consume(self, buffer: str, final: bool) -> tuple[list[Item], int]:
        """The items settled in `buffer` and how many of its characters they took (all of them if `final`)."""

    def for_tools(self, tools: list[dict[str, Any]]) -> ToolCallParser:
        """This parser for one request's tools (OpenAI's `{"type": "function", "function": {...}}`, checked).

        Formats whose arguments are text (qwen3_coder, glm45) return a parser that knows the tools' parameter
        schemas, to type each value; the JSON formats need nothing and return themselves."""
        return self

    def parse(self, text: str) -> list[Item]:
        """Every item of a whole output."""
        return self.consume(text, final=True)[0]
