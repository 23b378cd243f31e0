"""A Messages body's `system` and `messages` as the chat path's ChatMessages.

Text blocks become the turns' text; an assistant's `tool_use` blocks its tool calls and its earlier `thinking`
blocks its `reasoning_content`; a user's `tool_result` blocks `tool` turns answering those calls, its `image`
blocks image parts (actors/entry/image_input.py reads them). A final assistant message with text is continued:
Anthropic's prefill.
"""

from __future__ import annotations

import json
from typing import Any

from ringserve.actors.entry.anthropic.checks import CACHE_HINT, checked_object, checked_string, invalid
from ringserve.bus.errors import ApiError, clip
from ringserve.bus.messages import ChatMessage

_BLOCK_FIELDS = {"text": {"type", "text", "citations", CACHE_HINT},
                 "tool_use": {"type", "id", "name", "input", CACHE_HINT},
                 "tool_result": {"type", "tool_use_id", "content", "is_error", CACHE_HINT},
                 "image": {"type", "source", CACHE_HINT},
                 "thinking": {"type", "thinking", "signature", CACHE_HINT},
                 "redacted_thinking": {"type", "data", CACHE_HINT}}
# an assistant's earlier thinking: a thinking block reaches the template as the turn's reasoning_content; a
# redacted one (encrypted by Anthropic) is accepted and left out
THINKING_BLOCKS = ("thinking", "redacted_thinking")
ERROR_PREFIX = "Error: "  # a tool_result with is_error: true reaches the model as this, then its content


def _block(value: Any, where: str, allowed_types: tuple[str, ...]) -> dict[str, Any]:
    """One content block, checked: its type among `allowed_types` (others are named as not supported)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str):
        raise invalid(where, " must be a content block object with a string type")
    if kind not in allowed_types:
        scope = "here" if kind in _BLOCK_FIELDS else "by this server"
        raise invalid(where, f": {clip(kind)} blocks are not supported {scope}; this content takes "
                             f"{' and '.join(allowed_types)} blocks")
    block = checked_object(value, where, _BLOCK_FIELDS[kind])
    if kind == "text":
        checked_string(block.get("text"), f"{where}.text")
        if block.get("citations"):
            raise invalid(f"{where}.citations", ": citations are not supported")
    elif kind == "thinking":
        checked_string(block.get("thinking"), f"{where}.thinking")
    elif kind == "redacted_thinking":
        checked_string(block.get("data"), f"{where}.data")
    return block


def _texts(content: Any, where: str) -> str:
    """A string, or a list of text blocks, as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, " must be a string or a list of text blocks")
    return "".join(_block(b, f"{where}.{i}", ("text",))["text"] for i, b in enumerate(content))


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant's tool_use block as the chat path's tool call."""
    name, arguments = checked_string(block.get("name"), f"{where}.name"), block.get("input")
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.input", " must be an object")
    call_id = checked_string(block.get("id"), f"{where}.id")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _tool_turn(block: dict[str, Any], where: str, names: dict[str, str]) -> ChatMessage:
    """A user's tool_result block as a `tool` turn answering its call."""
    call_id = checked_string(block.get("tool_use_id"), f"{where}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else _texts(content, f"{where}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise invalid(f"{where}.is_error", " must be a boolean")
    return ChatMessage(role="tool", content=ERROR_PREFIX + text if is_error else text, tool_call_id=call_id,
                       name=names.get(call_id))


def parse_turns(system: Any, messages: Any) -> tuple[list[ChatMessage], bool]:
    """`system` and `messages` as ChatMessages, and whether the last (an assistant's text) is to be continued."""
    turns = [] if system is None else [ChatMessage(role="system", content=_texts(system, "system"))]
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    names: dict[str, str] = {}  # tool_use id -> the tool it called
    prefill = False
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        message = checked_object(message, where, {"role", "content"})
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise invalid(f"{where}.role", " must be user or assistant (the system prompt is the top-level system "
                                           "field)")
        last = i == len(messages) - 1
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list) or (not content and not (last and role == "assistant")):
            raise invalid(f"{where}.content", " must be a string or a non-empty list of content blocks")
        kinds = ("text", "tool_use", *THINKING_BLOCKS) if role == "assistant" else ("text", "image", "tool_result")
        blocks = [_block(b, f"{where}.content.{j}", kinds) for j, b in enumerate(content)]
        if role == "assistant":
            calls = [_tool_call(b, f"{where}.content.{j}") for j, b in enumerate(blocks) if b["type"] == "tool_use"]
            names.update((c["id"], c["function"]["name"]) for c in calls)
            text = "".join(b["text"] for b in blocks if b["type"] == "text")
            if last and not calls:
                prefill = bool(text)  # an empty final assistant turn is just the turn to open
                if not prefill:
                    break
            thinking = [b["thinking"] for b in blocks if b["type"] == "thinking"]
            turns.append(ChatMessage(role="assistant", content=text, tool_calls=calls,
                                     reasoning_content="".join(thinking) if thinking else None))
            continue
        turns += _user_turns(blocks, where, names)
    return turns, prefill


def _image_part(block: dict[str, Any], where: str) -> dict[str, str]:
    """An image block as a chat image part: its `source` (base64 with its media type, or a URL) as a URL, and where
    it was, for the 400 that a bad image gets (actors/entry/image_input.py)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        checked_object(source, f"{where}.source", {"type", "media_type", "data"})
        media = checked_string(source.get("media_type"), f"{where}.source.media_type")
        url = f"data:{media};base64,{checked_string(source.get('data'), f'{where}.source.data')}"
    elif kind == "url":
        checked_object(source, f"{where}.source", {"type", "url"})
        url = checked_string(source.get("url"), f"{where}.source.url")
    else:
        raise invalid(f"{where}.source", ": must be {\"type\": \"base64\", \"media_type\", \"data\"} or "
                                         "{\"type\": \"url\", \"url\"}")
    return {"type": "image", "url": url, "where": where}


def _user_turns(blocks: list[dict[str, Any]], where: str, names: dict[str, str]) -> list[ChatMessage]:
    """A user message's blocks in order: each tool result a `tool` turn, the text and images around them user
    turns (with images: their parts in order)."""
    turns: list[ChatMessage] = []
    parts: list[dict[str, str]] = []

    def user_turn() -> None:
        images = any(part["type"] == "image" for part in parts)
        text = "".join(part.get("text", "") for part in parts)
        turns.append(ChatMessage(role="user", content=text, parts=list(parts) if images else None))
        parts.clear()

    for j, block in enumerate(blocks):
        if block["type"] == "text":
            parts.append({"type": "text", "text": block["text"]})
            continue
        if block["type"] == "image":
            parts.append(_image_part(block, f"{where}.content.{j}"))
            continue
        if parts:
            user_turn()
        turns.append(_tool_turn(block, f"{where}.content.{j}", names))
    if parts:
        user_turn()
    return turns

