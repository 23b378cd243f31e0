"""gpt-oss's harmony messages (vLLM's `openai` tool-call parser): the output is a run of messages, each a header,
`<|message|>`, its text and an end marker.

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>

or, answering, `<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>`. The first message's
`<|start|>assistant` is in the prompt, so the output starts at `<|channel|>`; the recipient `to=functions.NAME`
may also stand in the role part (`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`, as
the chat template writes calls); `<|constrain|>json` is optional. A message addressed to `functions.NAME` is a
call of NAME with its JSON text as arguments; the text of `final` messages and of `commentary` messages to no one
(preambles the user may see) is the content, headers and end markers removed; `analysis` messages are the
thinking, which the reasoning parser takes before this one reads the text, and are never content. Text outside
any message (a model that writes no harmony) is content. A message to another recipient (a built-in tool such
as `browser.search`) or a call whose arguments are not a JSON object stays content, as written.

The markers are special tokens the detokenizer must keep. OpenAI's `openai-harmony` package parses these token by
token, but it downloads its tokenizer file at run time and the machines this serves on may have no internet, so
the text is read here.
"""

from __future__ import annotations

import json
import re

from ringserve.actors.entry.tool_parsers.base import Item, ParsedCall, ToolCallParser, call_from_json, held_back

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
OPENERS = (START, CHANNEL)
MARKERS = OPENERS + ENDS
RECIPIENT = re.compile(r"\bto=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
FUNCTIONS = "functions."


def _first(buffer: str, markers: tuple[str, ...], pos: int) -> tuple[int, str]:
    """The first of `markers` at or after `pos`, and where; (-1, "") if none."""
    found = [(at, marker) for marker in markers if (at := buffer.find(marker, pos)) >= 0]
    return min(found) if found else (-1, "")


def _call(recipient: str, body: str) -> ParsedCall | None:
    if not recipient.startswith(FUNCTIONS):
        return None
    try:
        return call_from_json({"name": recipient[len(FUNCTIONS):], "arguments": json.loads(body.strip() or "{}")})
    except (ValueError, RecursionError):
        return None


class HarmonyParser(ToolCallParser):
    """Harmony messages: calls out of `to=functions.NAME` messages, content out of `final` and preamble
    messages. The text of a content message streams as it comes; a call or an analysis message is held until
    its end marker (or the end of the output)."""

    name = "openai"
    keeps_special_tokens = True

    def consume(self, buffer: str, final: bool) -> tuple[list[Item], int]:
        items: list[Item] = []
        pos = 0
        while pos < len(buffer):
            at, marker = _first(buffer, MARKERS, pos)
            if at < 0:  # text: a content message's, once its header was read, or text outside harmony
                stop = len(buffer) if final else len(buffer) - held_back(buffer[pos:], MARKERS)
                if stop > pos:
                    items.append(buffer[pos:stop])
                return items, max(stop, pos)
            if at > pos:
                items.append(buffer[pos:at])
            if marker in ENDS:  # the end of a content message whose text went out already
                pos = at + len(marker)
                continue
            header_end = buffer.find(MESSAGE, at)
            if header_end < 0:
                if not final:
                    return items, at  # a header in progress
                items.append(buffer[at:])  # a header the output cut off
                return items, len(buffer)
            header = buffer[at:header_end]
            body = header_end + len(MESSAGE)
            recipient = RECIPIENT.search(header)
            channel = CHANNEL_NAME.search(header)
            if recipient is None and (channel is None or channel.group(1) != "analysis"):
                pos = body  # content: its text follows as text
                continue
            close, end = _first(buffer, ENDS, body)
            if close < 0 and not final:
                return items, at  # a call or the thinking in progress
            after = close + len(end) if close >= 0 else len(buffer)
            if recipient is not None:
                items.append(_call(recipient.group(1), buffer[body:close if close >= 0 else len(buffer)])
                             or buffer[at:after])
            pos = after
        return items, pos
