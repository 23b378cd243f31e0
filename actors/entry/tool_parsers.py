"""Tool-call parsers: find the tool calls in a model's text output (`tool_choice: "auto"`), by name.

A parser reads text in pieces: `consume(buffer, final)` returns the items it can settle in `buffer` (content
text and parsed calls, in order) and how many characters they took; the rest is kept for the next call, because
it may be the beginning of a tool call. With `final` everything is settled: a call that does not parse stays
content. The same method serves a whole reply and a stream.

| name | the model writes |
|---|---|
| `hermes` (default) | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes, Qwen) |
| `llama3_json` | only JSON objects `{"name": ..., "parameters": {...}}`, separated by `;`, optionally after `<\\|python_tag\\|>` |

`ringserve serve --tool-call-parser NAME` chooses one; add a parser by subclassing `ToolCallParser` and
listing it in `PARSERS`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Union

DEFAULT_PARSER = "hermes"


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


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker` (may become it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallParser(ABC):
    """Finds tool calls in generated text; stateless (one instance serves every request)."""

    name: str = ""

    @abstractmethod
    def consume(self, buffer: str, final: bool) -> tuple[list[Item], int]:
        """The items settled in `buffer` and how many of its characters they took (all of them if `final`)."""

    def parse(self, text: str) -> list[Item]:
        """Every item of a whole output."""
        return self.consume(text, final=True)[0]


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; text around them is content.

    A block the model left open at the end of its output still counts if its JSON is complete.
    """

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"

    def consume(self, buffer: str, final: bool) -> tuple[list[Item], int]:
        items: list[Item] = []
        pos = 0
        while True:
            start = buffer.find(self.START, pos)
            if start < 0:
                end = len(buffer) if final else len(buffer) - _partial_suffix(buffer[pos:], self.START)
                if end > pos:
                    items.append(buffer[pos:end])
                return items, end
            if start > pos:
                items.append(buffer[pos:start])
            end = buffer.find(self.END, start)
            if end < 0 and not final:
                return items, start  # a call in progress
            body_end = len(buffer) if end < 0 else end
            after = len(buffer) if end < 0 else end + len(self.END)
            items.append(self._call(buffer[start + len(self.START):body_end]) or buffer[start:after])
            pos = after
            if pos >= len(buffer):
                return items, pos

    @staticmethod
    def _call(body: str) -> ParsedCall | None:
        try:
            return call_from_json(json.loads(body))
        except ValueError:
            return None


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x's JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}` objects separated
    by `;` (optionally after `<|python_tag|>`); any other output is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def consume(self, buffer: str, final: bool) -> tuple[list[Item], int]:
        head = buffer.lstrip()
        if head.startswith(self.TAG):
            head = head[len(self.TAG):].lstrip()
        maybe_call = not head or head.startswith("{") or (self.TAG.startswith(head) and head.startswith("<"))
        if not final:
            return ([], 0) if maybe_call else ([buffer], len(buffer))
        calls = self._calls(head) if head.startswith("{") else None
        return (list(calls) if calls else [buffer] if buffer else []), len(buffer)

    @staticmethod
    def _calls(text: str) -> list[ParsedCall] | None:
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        pos = 0
        while pos < len(text):
            try:
                value, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            call = call_from_json(value)
            if call is None:
                return None
            calls.append(call)
            rest = text[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            pos = len(text) - len(rest)
        return calls


PARSERS: dict[str, ToolCallParser] = {parser.name: parser for parser in (HermesParser(), Llama3JsonParser())}


def get_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {', '.join(PARSERS)}") from None
