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
chat template asks for (`parser_for_template`). Add a parser by subclassing `ToolCallParser` (base.py)
and listing it in `PARSERS`.
"""

from __future__ import annotations

import re

from ringserve.actors.entry.tool_parsers.base import Item, ParsedCall, ToolCallParser, call_from_json
from ringserve.actors.entry.tool_parsers.json_formats import HermesParser, Llama3JsonParser
from ringserve.actors.entry.tool_parsers.mistral import MistralParser
from ringserve.actors.entry.tool_parsers.pythonic import PythonicParser

__all__ = ["AUTO", "DEFAULT_PARSER", "PARSERS", "HermesParser", "Item", "Llama3JsonParser", "MistralParser",
           "ParsedCall", "PythonicParser", "ToolCallParser", "call_from_json", "get_parser", "parser_for_template"]

DEFAULT_PARSER = "hermes"
AUTO = "auto"  # --tool-call-parser's default: chosen from the model's chat template (`parser_for_template`)
PARSERS: dict[str, ToolCallParser] = {parser.name: parser for parser in (
    HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser())}

# What a chat template writes or asks for, per format, in the order they are tried
_PYTHONIC = re.compile(r"\[\s*func_name\d*\s*\(|<\|python_start\|>")
_LLAMA3_JSON = re.compile(r"<\|python_tag\|>|\\?\"name\\?\": function name")  # Llama 3.1's and 3.2's


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's own tool-call format needs: Mistral's `[TOOL_CALLS]`, Hermes's and Qwen's
    `<tool_call>`, a pythonic list (`[func_name1(params_name1=...)]`, Llama 4's `<|python_start|>`), Llama 3.1's
    `<|python_tag|>` or its "respond in the format {"name": function name, ...}"; else Hermes (the format of
    the default tool prompt)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if _PYTHONIC.search(text):
        return "pythonic"
    if _LLAMA3_JSON.search(text):
        return "llama3_json"
    return DEFAULT_PARSER


def get_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {', '.join(PARSERS)}") from None
