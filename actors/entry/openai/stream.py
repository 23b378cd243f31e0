"""A streamed chat or completion response as OpenAI's chunks, fed the ring's outputs as they come (every choice's,
each choice's in order); `routes.stream_events` sends them as server-sent events.

A chat choice starts with a chunk that carries only the role, as OpenAI's does. An output's thinking
(`RequestOutput.reasoning_text`) comes first as a `delta.reasoning_content` chunk, never in `content`; its answer
text follows, read for tool calls by the choice's `ToolCallStream` when the model may call tools. With vLLM's
`continuous_usage_stats`, every chunk carries the usage so far.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ringserve.actors.entry.openai import bodies as bodies
from ringserve.actors.entry.openai.protocol import ApiOptions
from ringserve.actors.entry.tools.response import ToolCallStream
from ringserve.bus.messages import RequestOutput


def tool_chunks(rid: str, options: ApiOptions, stream: ToolCallStream, out: RequestOutput, index: int,
                logprobs: dict[str, Any] | None, carried: bool = False) -> list[dict[str, Any]]:
    """The chunks of one output of a chat choice that may call tools: its settled deltas (content, tool calls;
    the output's logprobs and token ids on the first, unless its thinking's chunk `carried` them), then the
    finish on a chunk of its own. Only the answer text is read for calls."""
    deltas = stream.feed(out.text)
    finish = None
    if out.finish is not None:
        tail, finish_type = stream.finish(out.finish.type)
        deltas += tail
        finish = dataclasses.replace(out.finish, type=finish_type)
    if not deltas and not carried and (logprobs is not None or (options.token_ids and out.token_ids)):
        deltas = [{"content": ""}]
    chunks = []
    for i, delta in enumerate(deltas):
        chunk = bodies.stream_chunk(rid, options, None, None, index=index, logprobs=None if i else logprobs,
                                    out=None if i or carried else out)
        chunk["choices"][0]["delta"] = delta
        chunks.append(chunk)
    if finish is not None:
        chunks.append(bodies.stream_chunk(rid, options, None, finish, index=index))
    return chunks


class StreamChunks:
    """The chunks of one streamed response with choices `indices`."""

    def __init__(self, rid: str, options: ApiOptions, indices: list[int]) -> None:
        self.rid = rid
        self.options = options
        self.formatters = {index: options.logprob_formatter() for index in indices}
        self.tool_streams = {index: ToolCallStream(options.tools) for index in indices} if options.tools else {}
        self.latest: dict[int, RequestOutput] = {}  # each started choice's newest output: its counts so far
        self.lasts: dict[int, RequestOutput] = {}  # each finished choice's last output

    def feed(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """The chunks output `out` (not an error) of choice `index` settles."""
        options, rid = self.options, self.rid
        first = index not in self.latest
        self.latest[index] = out
        chunks = [bodies.role_chunk(rid, options, index)] if first and options.kind == "chat" else []
        entries = options.entries(out)
        has_logprobs = options.logprobs and bool(entries)
        tools = self.tool_streams.get(index)
        logprobs = self.formatters[index].format(entries) if has_logprobs or tools is None else None
        carried = bool(out.reasoning_text)  # the thinking's chunk comes first, with the output's logprobs and ids
        if carried:
            chunks.append(bodies.reasoning_chunk(rid, options, out, index, logprobs, first))
            logprobs, has_logprobs = None, False
        if tools is not None:
            chunks += tool_chunks(rid, options, tools, out, index, logprobs, carried)
        elif (first and options.kind != "chat") or out.text or out.finish is not None or has_logprobs:
            chunks.append(bodies.stream_chunk(rid, options, out.text, out.finish, first=first and not carried,
                                              index=index, logprobs=logprobs, out=None if carried else out))
        if out.is_last:
            self.lasts[index] = out
        if options.continuous_usage:
            for chunk in chunks:
                chunk["usage"] = bodies.running_usage(self.latest, options.n)
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: the usage of every finished choice."""
        return bodies.usage_chunk(self.rid, self.options, [self.lasts[i] for i in sorted(self.lasts)])
