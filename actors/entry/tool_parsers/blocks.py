"""Formats whose calls sit in tagged blocks amid text (Hermes's `<tool_call>`, Qwen3-Coder's, GLM-4.5's, DeepSeek's
and Kimi-K2's sections): the text outside the blocks is content, streamed as it comes except an end that may
begin a block's tag; a block is held until its end tag, then read whole. A block the output left open counts at
the end if it reads; a block that does not read stays content, tags and all."""

from __future__ import annotations

from abc import abstractmethod

from ringserve.actors.entry.tool_parsers.base import Item, ParsedCall, ToolCallParser, held_back


class BlockParser(ToolCallParser):
    """A parser of tagged blocks: `BLOCKS` lists each block's start tag and the end tags that close it; `read`
    turns one block into its calls."""

    BLOCKS: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @abstractmethod
    def read(self, block: str) -> list[ParsedCall] | None:
        """The calls of one block (its text from the start tag to the end tag, both included; without the end
        tag when the output ended inside it), None if it does not read as calls."""

    def consume(self, buffer: str, final: bool) -> tuple[list[Item], int]:
        items: list[Item] = []
        pos = 0
        while True:
            start, tag, ends = self._next_block(buffer, pos)
            if start < 0:
                stop = len(buffer) if final else len(buffer) - held_back(buffer[pos:], [s for s, _ in self.BLOCKS])
                if stop > pos:
                    items.append(buffer[pos:stop])
                return items, max(stop, pos)
            if start > pos:
                items.append(buffer[pos:start])
            found = [(at, end) for end in ends if (at := buffer.find(end, start + len(tag))) >= 0]
            if not found and not final:
                return items, start  # a block in progress
            close, end = min(found) if found else (len(buffer), "")
            after = close + len(end)
            calls = self.read(buffer[start:after])
            if calls:
                items.extend(calls)
            else:
                items.append(buffer[start:after])
            pos = after
            if pos >= len(buffer):
                return items, pos

    def _next_block(self, buffer: str, pos: int) -> tuple[int, str, tuple[str, ...]]:
        """Where the first block at or after `pos` starts (-1 if none), its start tag and the end tags that
        close it."""
        best: tuple[int, str, tuple[str, ...]] = (-1, "", ())
        for start, ends in self.BLOCKS:
            at = buffer.find(start, pos)
            if at >= 0 and (best[0] < 0 or at < best[0]):
                best = (at, start, ends)
        return best


def section_calls(body: str, begin: str, end: str) -> list[str] | None:
    """The calls of a section body made of `begin`...`end` pieces (blank between them; the last may lack its
    `end` when the output stopped there), each piece's inner text; None if anything else is there or none is."""
    pieces = []
    rest = body.strip()
    while rest:
        if not rest.startswith(begin):
            return None
        close = rest.find(end)
        pieces.append(rest[len(begin):close if close >= 0 else len(rest)])
        rest = rest[close + len(end):].strip() if close >= 0 else ""
    return pieces or None


def strip_tags(block: str, start: str, ends: tuple[str, ...]) -> str:
    """A block's text inside its start tag and whichever end tag closes it (if any does)."""
    body = block[len(start):] if block.startswith(start) else block
    for tag in ends:
        if body.endswith(tag):
            return body[:-len(tag)]
    return body
