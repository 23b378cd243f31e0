"""Tool calls in chat responses: read out of a choice's text, as a whole message or as stream deltas.

With `tool_choice: "auto"` the request's parser (`actors/entry/tool_parsers/`) finds the calls in the text;
with `required` the constrained output is a JSON array of `{"name", "arguments"}`, and with a named function
it is that function's arguments object. Calls get ids `call_<24 hex digits>`; a reply with calls that ended
with a stop has `finish_reason: "tool_calls"`, and its `content` is the text outside the calls (null if none).
Output that does not parse (e.g. JSON cut short by max_tokens) stays content, with its finish reason.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from ringserve.actors.entry.tool_parsers import Item, ParsedCall, call_from_json
from ringserve.actors.entry.tools.request import ToolPlan


def new_call_id() -> str:
    """A fresh tool-call id, as OpenAI's look: `call_` and random characters."""
    return "call_" + secrets.token_hex(12)


def _forced_items(plan: ToolPlan, text: str) -> list[Item]:
    """The call(s) of a constrained output (`required` or a named function); the text itself if it does not
    parse."""
    try:
        value = json.loads(text)
    except ValueError:
        return [text] if text else []
    if plan.choice == "function" and isinstance(value, dict):
        assert plan.function is not None
        return [ParsedCall(plan.function, json.dumps(value, ensure_ascii=False))]
    if plan.choice == "required" and isinstance(value, list) and value:
        calls = [call_from_json(v, ("arguments",)) for v in value]
        if all(call is not None for call in calls):
            return [call for call in calls if call is not None]
    return [text]


def settle(plan: ToolPlan, text: str) -> list[Item]:
    """Every item (content text, calls) of a whole output."""
    return plan.parser.parse(text) if plan.choice == "auto" else _forced_items(plan, text)


def tool_call_body(call: ParsedCall, call_id: str | None = None) -> dict[str, Any]:
    """One entry of `message.tool_calls`."""
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def final_finish(has_calls: bool, finish_type: str | None) -> str | None:
    """A reply that made calls and stopped finished for "tool_calls"; other finishes (length) stay."""
    return "tool_calls" if has_calls and finish_type == "stop" else finish_type


def tool_message(plan: ToolPlan, text: str, finish_type: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a whole reply, and its finish reason."""
    items = settle(plan, text)
    calls = [item for item in items if isinstance(item, ParsedCall)]
    if not plan.parallel:
        calls = calls[:1]
    outside = "".join(item for item in items if isinstance(item, str))  # the text (harmony's: without headers)
    if not calls:
        return {"role": "assistant", "content": outside}, finish_type
    content = outside.strip() or None
    return ({"role": "assistant", "content": content, "tool_calls": [tool_call_body(c) for c in calls]},
            final_finish(True, finish_type))


class ToolCallStream:
    """One streamed choice's text turned into chat deltas: `{"content": ...}` as soon as it cannot be part of
    a call, `{"tool_calls": [...]}` once a call is complete (id, type and name first, then the arguments).

    Constrained calls (`required`, named) are held to the end, then sent. Whitespace right before a call is
    dropped, as in the whole message.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.pending = ""  # text not settled yet: it may belong to a call
        self.space = ""  # trailing whitespace of the content sent so far, held back
        self.calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas `text` settles."""
        self.pending += text
        if self.plan.choice != "auto":
            return []
        items, used = self.plan.parser.consume(self.pending, final=False)
        self.pending = self.pending[used:]
        return self._deltas(items)

    def finish(self, finish_type: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas, and the choice's finish reason."""
        items = settle(self.plan, self.pending)
        self.pending = ""
        deltas = self._deltas(items)
        if not self.calls and self.space:
            deltas.append({"content": self.space})
        self.space = ""
        return deltas, final_finish(self.calls > 0, finish_type)

    def _deltas(self, items: list[Item]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, str):
                text = self.space + item
                kept = text.rstrip()
                self.space = text[len(kept):]
                if kept:
                    if deltas and "content" in deltas[-1]:
                        deltas[-1]["content"] += kept
                    else:
                        deltas.append({"content": kept})
                continue
            if self.calls and not self.plan.parallel:
                continue
            self.space = ""
            deltas.append({"tool_calls": [{"index": self.calls, "id": new_call_id(), "type": "function",
                                           "function": {"name": item.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": self.calls, "function": {"arguments": item.arguments}}]})
            self.calls += 1
        return deltas
