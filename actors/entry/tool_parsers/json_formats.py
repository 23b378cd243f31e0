"""The JSON tool-call formats: Hermes's `<tool_call>` blocks (Hermes, Qwen) and Llama 3.x's bare JSON calls."""

from __future__ import annotations

import json

from ringserve.actors.entry.tool_parsers.base import Item, ParsedCall, ToolCallParser, call_from_json, content_or_calls
from ringserve.actors.entry.tool_parsers.blocks import BlockParser, strip_tags


class HermesParser(BlockParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; text around them is content.

    A block the model left open at the end of its output still counts if its JSON is complete.
    """

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"
    BLOCKS = ((START, (END,)),)

    def read(self, block: str) -> list[ParsedCall] | None:
        try:
            call = call_from_json(json.loads(strip_tags(block, self.START, (self.END,))))
        except (ValueError, RecursionError):
            return None
        return [call] if call else None


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
        return content_or_calls(buffer, self._calls(head) if head.startswith("{") else None)

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
