"""Mistral's tool calls: `[TOOL_CALLS]` then a JSON list of calls (v3 tokenizers), or `[TOOL_CALLS]name[ARGS]{...}`
once per call (v11 and later; `[CALL_ID]id` may follow the name)."""

from __future__ import annotations

import json

from ringserve.actors.entry.tool_parsers.base import (
    Item, ParsedCall, ToolCallParser, call_from_json, content_or_calls, json_list_calls, partial_suffix)


class MistralParser(ToolCallParser):
    """`[TOOL_CALLS]` and the calls after it; text before the first tag is content, and is streamed as it comes
    except an end that may begin the tag. The calls are read when the output ends; calls that do not parse stay
    content.

    `[TOOL_CALLS]` is a special token: a chat request with tools decodes with `skip_special_tokens` false
    unless it sets it (openai/protocol.py parse_chat); an output that starts with a JSON list of calls (v3 without
    its tag) is read as calls too.
    """

    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS], [ARGS], [CALL_ID]
    TAG = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"

    def consume(self, buffer: str, final: bool) -> tuple[list[Item], int]:
        start = buffer.find(self.TAG)
        if start < 0:
            head = buffer.lstrip()
            if head.startswith("[{") or (head in ("", "[") and not final):  # maybe a list whose tag was skipped
                return content_or_calls(buffer, json_list_calls(head)) if final else ([], 0)
            end = len(buffer) if final else len(buffer) - partial_suffix(buffer, self.TAG)
            return ([buffer[:end]] if end else []), end
        items: list[Item] = [buffer[:start]] if start else []
        if not final:
            return items, start  # calls in progress
        settled, used = content_or_calls(buffer[start:], self._calls(buffer[start:]))
        return items + settled, start + used

    def _calls(self, text: str) -> list[ParsedCall] | None:
        body = text[len(self.TAG):].strip()
        if body.startswith("["):  # v3: one JSON list
            return json_list_calls(body)
        calls = []
        for part in text.split(self.TAG)[1:]:  # v11: name[ARGS]{...} after each tag
            name, sep, arguments = part.partition(self.ARGS)
            name = name.partition(self.CALL_ID)[0].strip()
            try:
                call = call_from_json({"name": name, "arguments": json.loads(arguments)}) if sep else None
            except ValueError:
                return None
            if call is None:
                return None
            calls.append(call)
        return calls
