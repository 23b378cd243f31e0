"""GLM-4.5's tool calls (GLM-4.5, 4.6 and 4.7; vLLM's and SGLang's `glm45`):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Argument values are text, typed by the tool's schema (text_arguments.py). The tags are ordinary added tokens
of GLM's tokenizer, not special ones: they survive `skip_special_tokens`.
"""

from __future__ import annotations

import re

from ringserve.actors.entry.tool_parsers.base import ParsedCall
from ringserve.actors.entry.tool_parsers.blocks import strip_tags
from ringserve.actors.entry.tool_parsers.text_arguments import TextArgumentsParser

START, END = "<tool_call>", "</tool_call>"
KEY = "<arg_key>"
PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
NAME = re.compile(r"[^\s<>{}\"']+")


class Glm45Parser(TextArgumentsParser):
    """`<tool_call>` blocks, each the function's name then `<arg_key>`/`<arg_value>` pairs; text around the
    blocks is content. A block with anything else in it (a name that is not one word, text between the pairs)
    stays content."""

    name = "glm45"
    BLOCKS = ((START, (END,)),)

    def read(self, block: str) -> list[ParsedCall] | None:
        body = strip_tags(block, START, (END,))
        pos = body.find(KEY) if KEY in body else len(body)
        name = body[:pos].strip()
        if not NAME.fullmatch(name):
            return None
        pairs = []
        for pair in PAIR.finditer(body, pos):
            if body[pos:pair.start()].strip():
                return None
            pairs.append((pair.group(1), pair.group(2)))
            pos = pair.end()
        call = self.call(name, pairs) if not body[pos:].strip() else None
        return [call] if call else None
