"""Tool-call parsers: find the tool calls in a model's text output (`tool_choice: "auto"`), by name.

A parser reads text in pieces: `consume(buffer, final)` returns the items it can settle in `buffer` (content
text and parsed calls, in order) and how many characters they took; the rest is kept for the next call, because
it may be the beginning of a tool call. With `final` everything is settled: a call that does not parse stays
content. The same method serves a whole reply and a stream.

| name | the model writes |
|---|---|
| `hermes` (default) | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes, Qwen) |
| `llama3_json` | only JSON objects `{"name": ..., "parameters": {...}}`, separated by `;`, optionally after `<\\|python_tag\\|>` |
| `mistral` | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]name[ARGS]{...}` per call |
| `pythonic` | only a Python list of calls with keyword arguments: `[get_weather(city="Paris")]` |

`ringserve serve --tool-call-parser NAME` chooses one; by default (`auto`) the launcher picks the one the model's
chat template asks for (`parser_for_template`). Add a parser by subclassing `ToolCallParser` and listing it in
`PARSERS`.
"""

from __future__ import annotations

import ast
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


class MistralParser(ToolCallParser):
    """Mistral's `[TOOL_CALLS]`: a JSON list of calls after it (v3 tokenizers), or one `name[ARGS]{...}` after
    each (v11 and later); text before the first is content. The calls are read when the output ends."""

    name = "mistral"
    TAG = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def consume(self, buffer: str, final: bool) -> tuple[list[Item], int]:
        start = buffer.find(self.TAG)
        if start < 0:
            end = len(buffer) if final else len(buffer) - _partial_suffix(buffer, self.TAG)
            return ([buffer[:end]] if end else []), end
        items: list[Item] = [buffer[:start]] if start else []
        if not final:
            return items, start  # calls in progress
        calls = self._calls(buffer[start:])
        return items + (list(calls) if calls else [buffer[start:]]), len(buffer)

    def _calls(self, text: str) -> list[ParsedCall] | None:
        body = text[len(self.TAG):].strip()
        if body.startswith("["):  # v3: one JSON list
            try:
                values = json.loads(body)
            except ValueError:
                return None
            calls = [call_from_json(v) for v in values] if isinstance(values, list) else [None]
            return None if not calls or None in calls else calls  # type: ignore[return-value]
        calls = []
        for part in text.split(self.TAG)[1:]:  # v11: name[ARGS]{...} after each tag
            name, sep, arguments = part.partition(self.ARGS)
            try:
                call = call_from_json({"name": name.strip(), "arguments": json.loads(arguments)}) if sep else None
            except ValueError:
                return None
            if call is None:
                return None
            calls.append(call)
        return calls


class PythonicParser(ToolCallParser):
    """A Python list of calls with keyword arguments, `[get_weather(city="Paris"), f(x=[1, 2])]` (Llama 3.2's and
    Llama 4's pythonic format), read with `ast` (literal arguments only; nothing is evaluated). An output that is
    not such a list is content; it is read when the output ends."""

    name = "pythonic"

    def consume(self, buffer: str, final: bool) -> tuple[list[Item], int]:
        head = buffer.lstrip()
        if not final:
            return ([], 0) if not head or head.startswith("[") else ([buffer], len(buffer))
        calls = self._calls(head) if head.startswith("[") else None
        return (list(calls) if calls else [buffer] if buffer else []), len(buffer)

    @staticmethod
    def _calls(text: str) -> list[ParsedCall] | None:
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
                return None
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except ValueError:
                return None
            calls.append(ParsedCall(ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False)))
        return calls


PARSERS: dict[str, ToolCallParser] = {parser.name: parser for parser in (
    HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser())}
AUTO = "auto"  # --tool-call-parser's default: chosen from the model's chat template (`parser_for_template`)


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's own tool-call format needs: Mistral's `[TOOL_CALLS]`, Llama 3.1's
    `<|python_tag|>`/"parameters" JSON, a pythonic list, else Hermes's `<tool_call>` (also Qwen's)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if "func_name1(" in text or "<|python_start|>" in text:
        return "pythonic"
    if "<|python_tag|>" in text or '"parameters"' in text:
        return "llama3_json"
    return DEFAULT_PARSER


def get_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {', '.join(PARSERS)}") from None
