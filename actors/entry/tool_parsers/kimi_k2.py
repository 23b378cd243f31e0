"""Kimi-K2's tool calls (Kimi-K2 Instruct and Thinking; vLLM's and SGLang's `kimi_k2`):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

Each call is named by an id `functions.NAME:INDEX`; the name is read from it. The model sometimes writes the
section's tags in the singular (`<|tool_call_section_begin|>`), which is read too. The tags are special tokens
the detokenizer must keep.
"""

from __future__ import annotations

import json
import re

from ringserve.actors.entry.tool_parsers.base import ParsedCall, call_from_json
from ringserve.actors.entry.tool_parsers.blocks import BlockParser, section_calls, strip_tags

SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
SECTION_STARTS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
CALL_BEGIN, CALL_END, ARGUMENTS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
CALL_ID = re.compile(r"\s*(?:functions\.)?([\w.\-]+?)(?::\d+)?\s*")


def _call(piece: str) -> ParsedCall | None:
    """One call's text between `<|tool_call_begin|>` and `<|tool_call_end|>`."""
    call_id, sep, arguments = piece.partition(ARGUMENTS)
    name = CALL_ID.fullmatch(call_id)
    if not sep or not name:
        return None
    try:
        return call_from_json({"name": name.group(1), "arguments": json.loads(arguments)})
    except (ValueError, RecursionError):
        return None


class KimiK2Parser(BlockParser):
    """A tool-calls section; text before it is content. A section with a call that does not read stays content
    whole."""

    name = "kimi_k2"
    keeps_special_tokens = True
    BLOCKS = tuple((start, SECTION_ENDS) for start in SECTION_STARTS)

    def read(self, block: str) -> list[ParsedCall] | None:
        start = next(tag for tag in SECTION_STARTS if block.startswith(tag))
        pieces = section_calls(strip_tags(block, start, SECTION_ENDS), CALL_BEGIN, CALL_END)
        calls = [_call(piece) for piece in pieces or []]
        return None if not calls or None in calls else calls  # type: ignore[return-value]
