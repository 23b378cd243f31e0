"""DeepSeek V3's and R1's tool calls (vLLM's and SGLang's `deepseek_v3`), and V3.1's shorter form of each call.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 writes a call as
`<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`. The tags use full-width bars
(U+FF5C) and U+2581 for the spaces; they are special tokens the detokenizer must keep.
"""

from __future__ import annotations

import json
import re

from ringserve.actors.entry.tool_parsers.base import ParsedCall, call_from_json
from ringserve.actors.entry.tool_parsers.blocks import BlockParser, section_calls, strip_tags

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# V3: the name on the first line, then the arguments, in a ```json fence as the template writes them (or bare)
NAME_THEN_JSON = re.compile(r"\s*([^\s`]+)[ \t]*\n\s*(?:```(?:json)?\s*\n?(.*?)\s*```|(.*?))\s*", re.DOTALL)


def _call(piece: str) -> ParsedCall | None:
    """One call's text between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`."""
    head, sep, tail = piece.partition(SEP)
    if not sep:
        return None
    name, arguments = head, tail  # V3.1
    v3 = NAME_THEN_JSON.fullmatch(tail) if head.strip() == "function" else None
    if v3:
        name, arguments = v3.group(1), v3.group(2) if v3.group(2) is not None else v3.group(3)
    try:
        return call_from_json({"name": name.strip(), "arguments": json.loads(arguments)})
    except (ValueError, RecursionError):
        return None


class DeepSeekV3Parser(BlockParser):
    """A `<｜tool▁calls▁begin｜>` section of calls; text before it is content. A section with a call that does
    not read stays content whole."""

    name = "deepseek_v3"
    keeps_special_tokens = True
    BLOCKS = ((CALLS_BEGIN, (CALLS_END,)),)

    def read(self, block: str) -> list[ParsedCall] | None:
        pieces = section_calls(strip_tags(block, CALLS_BEGIN, (CALLS_END,)), CALL_BEGIN, CALL_END)
        calls = [_call(piece) for piece in pieces or []]
        return None if not calls or None in calls else calls  # type: ignore[return-value]
