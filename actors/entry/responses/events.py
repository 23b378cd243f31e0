"""One response's output as it comes, for the Responses API: the output items (a `reasoning` item with the
model's thinking as `reasoning_text` content, a `message` with `output_text`, `function_call`s) and, streamed,
OpenAI's events for them, each `event: <type>` with a `sequence_number`.

The thinking (`RequestOutput.reasoning_text`) opens a reasoning item before the answer's items; the answer text
is read by the chat path's `ToolCallStream` (tool calls never stream as text). The whole response is built by
the same machine, so the streamed deltas joined are the non-streamed text. An item still open when the output
is cut short (max_output_tokens, an abort) ends `incomplete`.
"""

from __future__ import annotations

import json
from typing import Any

from ringserve.actors.entry.responses import protocol as rp
from ringserve.actors.entry.tools.response import ToolCallStream
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import RequestOutput


class OutputItems:
    """The output items of one response, fed its outputs in order; `feed` returns the SSE text they settle."""

    def __init__(self, options: rp.ResponseOptions) -> None:
        self.options = options
        self.tool_stream = ToolCallStream(options.tools) if options.tools is not None else None
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item still receiving deltas
        self.sequence = 0
        self.last: RequestOutput | None = None

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def start(self) -> str:
        body = rp.response_object(self.options, "in_progress", [])
        return self.event("response.created", response=body) + self.event("response.in_progress", response=body)

    def feed(self, out: RequestOutput) -> str:
        """The events `out` settles (with its finish: the items' ends, not the response's)."""
        self.last = out
        tools = self.tool_stream
        deltas = [{"reasoning": out.reasoning_text}] * bool(out.reasoning_text)
        deltas += tools.feed(out.text) if tools else [{"content": out.text}] * bool(out.text)
        if tools and out.finish is not None:
            deltas += tools.finish(out.finish.type)[0]
        events = "".join(self._delta(delta) for delta in deltas)
        if out.finish is not None:
            events += self._close("incomplete" if out.finish.type in ("length", "abort") else "completed")
        return events

    def result(self) -> tuple[str, dict[str, Any]]:
        """(status, the response object) once the last output was fed; an aborted response is cancelled."""
        out = self.last
        assert out is not None and out.finish is not None
        status, incomplete = "completed", None
        if out.finish.type == "abort":
            status = "cancelled"
        elif out.finish.type == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        use = rp.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
        return status, rp.response_object(self.options, status, self.items, use, incomplete)

    def end(self) -> str:
        """The terminal event, with the whole response."""
        status, body = self.result()
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        return self.event(kind, response=body)

    def failed(self, exc: ApiError) -> tuple[str, dict[str, Any]]:
        """The `response.failed` event of an error after the stream began, and the failed response."""
        body = rp.response_object(self.options, "failed", self.items,
                                  error={"code": exc.type or "server_error", "message": exc.message})
        return self.event("response.failed", response=body), body

    def _delta(self, delta: dict[str, Any]) -> str:
        if "reasoning" in delta:
            return self._text(delta["reasoning"], "reasoning", "reasoning_text")
        if "content" in delta:
            return self._text(delta["content"], "message", "output_text")
        call = delta["tool_calls"][0]
        if "id" in call:
            return self._close() + self._add(rp.function_call_item(call["id"], call["function"]["name"], "",
                                                                   "in_progress"))
        assert self.open is not None
        self.open["arguments"] += call["function"]["arguments"]
        return self.event("response.function_call_arguments.delta", **self._where(),
                          delta=call["function"]["arguments"])

    def _text(self, text: str, item_type: str, part_type: str) -> str:
        """The events of text for a `message` (output_text) or `reasoning` (reasoning_text) item, opening the
        item and its one content part first unless it is the open item."""
        events = ""
        if self.open is None or self.open["type"] != item_type:
            item = {"type": "message", "id": rp.new_item_id("msg"), "status": "in_progress", "role": "assistant",
                    "content": []} if item_type == "message" else rp.reasoning_item("in_progress")
            events += self._close() + self._add(item)
            events += self.event("response.content_part.added", **self._where(), content_index=0,
                                 part=_part(part_type, ""))
            item["content"] = [_part(part_type, "")]
        assert self.open is not None
        self.open["content"][0]["text"] += text
        kind = "response.output_text.delta" if item_type == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if item_type == "message" else {}
        return events + self.event(kind, **self._where(), content_index=0, delta=text, **extra)

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _add(self, item: dict[str, Any]) -> str:
        self.items.append(item)
        self.open = item
        return self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _close(self, status: str = "completed") -> str:
        """The events that end the open item (if any), which ends with `status`."""
        item = self.open
        if item is None:
            return ""
        events = ""
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            if item["type"] == "message":
                events += self.event("response.output_text.done", **self._where(), content_index=0,
                                     text=part["text"], logprobs=[])
            else:
                events += self.event("response.reasoning_text.done", **self._where(), content_index=0,
                                     text=part["text"])
            events += self.event("response.content_part.done", **self._where(), content_index=0, part=part)
        else:
            events += self.event("response.function_call_arguments.done", **self._where(), name=item["name"],
                                 arguments=item["arguments"])
        item["status"] = status
        events += self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)
        self.open = None
        return events


def _part(part_type: str, text: str) -> dict[str, Any]:
    """A content part: `output_text` (a message's, with its annotations) or `reasoning_text` (a reasoning item's)."""
    return {"type": part_type, "text": text, "annotations": []} if part_type == "output_text" else {
        "type": part_type, "text": text}
