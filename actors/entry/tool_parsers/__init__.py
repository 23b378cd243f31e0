"""Tool-call parsers: find the tool calls in a model's text output (`tool_choice: "auto"`), by name.

A parser reads text in pieces: `consume(buffer, final)` returns the items it can settle in `buffer` (content
text and parsed calls, in order) and how many characters they took; the rest is kept for the next call, because
it may be the beginning of a tool call. With `final` everything is settled: a call that does not parse stays
content. The same method serves a whole reply and a stream. A request reads its output with
`get_parser(name).for_tools(tools)`: the formats whose arguments are text type them by the request's tool schemas.

| name | the model writes |
|---|---|
| `hermes` (default) | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes, Qwen) |
| `llama3_json` | only JSON objects `{"name": ..., "parameters": {...}}`, separated by `;`, optionally after `<\\|python_tag\\|>` |
| `mistral` | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]name[ARGS]{...}` per call |
| `pythonic` | only a Python list of calls with keyword arguments: `[get_weather(city="Paris")]` |
| `qwen3_coder` | `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>` (Qwen3-Coder, Qwen3.5); values typed by the tool's schema |
| `glm45` | `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>` (GLM-4.5, 4.6, 4.7); values typed by the tool's schema |
| `deepseek_v3` | `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and a ```` ```json ```` fence (V3, R1), or `NAME<｜tool▁sep｜>{...}` (V3.1), closed by `<｜tool▁call▁end｜>` |
| `kimi_k2` | `<\\|tool_calls_section_begin\\|>` then per call `<\\|tool_call_begin\\|>functions.NAME:0<\\|tool_call_argument_begin\\|>{...}<\\|tool_call_end\\|>` |
| `openai` | gpt-oss's harmony messages: `<\\|channel\\|>commentary to=functions.NAME <\\|constrain\\|>json<\\|message\\|>{...}<\\|call\\|>`; content is the `final` channel's text |

`ringserve serve --tool-call-parser NAME` chooses one; by default (`auto`) the launcher picks the one the model's
chat template asks for (`parser_for_template`). Add a parser by subclassing `ToolCallParser` (base.py), or
`BlockParser` (blocks.py) for calls in tagged blocks, and listing it in `PARSERS`.
"""

from __future__ import annotations

import re

from ringserve.actors.entry.tool_parsers.base import Item, ParsedCall, ToolCallParser, call_from_json
from ringserve.actors.entry.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from ringserve.actors.entry.tool_parsers.glm45 import Glm45Parser
from ringserve.actors.entry.tool_parsers.harmony import HarmonyParser
from ringserve.actors.entry.tool_parsers.json_formats import HermesParser, Llama3JsonParser
from ringserve.actors.entry.tool_parsers.kimi_k2 import KimiK2Parser
from ringserve.actors.entry.tool_parsers.mistral import MistralParser
from ringserve.actors.entry.tool_parsers.pythonic import PythonicParser
from ringserve.actors.entry.tool_parsers.qwen3_coder import Qwen3CoderParser

__all__ = ["AUTO", "DEFAULT_PARSER", "PARSERS", "DeepSeekV3Parser", "Glm45Parser", "HarmonyParser", "HermesParser",
           "Item", "KimiK2Parser", "Llama3JsonParser", "MistralParser", "ParsedCall", "PythonicParser",
           "Qwen3CoderParser", "ToolCallParser", "call_from_json", "get_parser", "parser_for_template"]

DEFAULT_PARSER = "hermes"
AUTO = "auto"  # --tool-call-parser's default: chosen from the model's chat template (`parser_for_template`)
PARSERS: dict[str, ToolCallParser] = {parser.name: parser for parser in (
    HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser(), Qwen3CoderParser(), Glm45Parser(),
    DeepSeekV3Parser(), KimiK2Parser(), HarmonyParser())}

# What a chat template writes or asks for, per format, in the order they are tried: the formats that also write
# `<tool_call>` (Qwen3-Coder's, GLM-4.5's) before Hermes's
_MARKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mistral", ("[TOOL_CALLS]",)),
    ("openai", ("<|channel|>", "<|call|>")),
    ("kimi_k2", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>")),
    ("deepseek_v3", ("<｜tool▁calls▁begin｜>", "tool▁sep")),
    ("glm45", ("<arg_key>",)),
)
_PYTHONIC = re.compile(r"\[\s*func_name\d*\s*\(|<\|python_start\|>")
_LLAMA3_JSON = re.compile(r"<\|python_tag\|>|\\?\"name\\?\": function name")  # Llama 3.1's and 3.2's


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's own tool-call format needs: Mistral's `[TOOL_CALLS]`, gpt-oss's harmony
    `<|channel|>`/`<|call|>`, Kimi-K2's `<|tool_calls_section_begin|>`/`<|tool_call_begin|>`, DeepSeek's
    `<｜tool▁calls▁begin｜>`/`tool▁sep`, GLM-4.5's `<arg_key>`, Qwen3-Coder's `<function=` with `<parameter=`,
    Hermes's and Qwen's `<tool_call>`, a pythonic list (`[func_name1(params_name1=...)]`, Llama 4's
    `<|python_start|>`), Llama 3.1's `<|python_tag|>` or its "respond in the format {"name": function name,
    ...}"; else Hermes (the format of the default tool prompt)."""
    text = template or ""
    for parser, marks in _MARKS:
        if any(mark in text for mark in marks):
            return parser
    if "<function=" in text and "<parameter=" in text:
        return "qwen3_coder"
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
