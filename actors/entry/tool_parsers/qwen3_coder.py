"""Qwen3-Coder's XML tool calls (Qwen3-Coder, Qwen3.5; vLLM's and SGLang's `qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text, typed by the tool's schema (text_arguments.py). The tags are ordinary added tokens
of these models' tokenizers, not special ones: they survive `skip_special_tokens`.
"""

from __future__ import annotations

import re

from ringserve.actors.entry.tool_parsers.base import ParsedCall
from ringserve.actors.entry.tool_parsers.blocks import strip_tags
from ringserve.actors.entry.tool_parsers.text_arguments import TextArgumentsParser

START, END = "<tool_call>", "</tool_call>"
# A function must be closed (an output cut short inside one is not a call); a parameter left unclosed ends where
# the next one or the function does, as the peers read it
FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _value(text: str) -> str:
    """A parameter's text without the line break the template writes on each side of it."""
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


class Qwen3CoderParser(TextArgumentsParser):
    """`<tool_call>` blocks holding one or more `<function=NAME>` elements of `<parameter=KEY>` values; text
    around the blocks is content. A `<function=...>` the model wrote without `<tool_call>` around it counts too.
    A block with anything but blanks between its elements, or a function the output left unclosed (cut short),
    stays content."""

    name = "qwen3_coder"
    BLOCKS = ((START, (END,)), ("<function=", ("</function>",)))

    def read(self, block: str) -> list[ParsedCall] | None:
        body = strip_tags(block, START, (END,))
        calls: list[ParsedCall] = []
        pos = 0
        for function in FUNCTION.finditer(body):
            pairs = self._pairs(function.group(2))
            if pairs is None or body[pos:function.start()].strip():
                return None
            call = self.call(function.group(1), pairs)
            if call is None:
                return None
            calls.append(call)
            pos = function.end()
        return calls if calls and not body[pos:].strip() else None

    @staticmethod
    def _pairs(inner: str) -> list[tuple[str, str]] | None:
        pairs = []
        pos = 0
        for parameter in PARAMETER.finditer(inner):
            if inner[pos:parameter.start()].strip():
                return None
            pairs.append((parameter.group(1), _value(parameter.group(2))))
            pos = parameter.end()
        return pairs if not inner[pos:].strip() else None
