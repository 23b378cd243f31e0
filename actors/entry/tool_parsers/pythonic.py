"""The pythonic tool-call format (Llama 3.2's and Llama 4's, vLLM's `pythonic`): the whole output is a Python list
of calls with keyword arguments, `[get_weather(city="Paris"), f(x=[1, 2])]`, read with `ast`. Only literal
arguments are taken (`ast.literal_eval`); nothing the model writes is ever evaluated."""

from __future__ import annotations

import ast
import json
from typing import Any

from ringserve.actors.entry.tool_parsers.base import Item, ParsedCall, ToolCallParser, content_or_calls

START, END = "<|python_start|>", "<|python_end|>"  # Llama 4 wraps the list in these (kept special tokens)


def _unwrapped(text: str) -> str:
    """`text` without blanks around it and without Llama 4's `<|python_start|>`/`<|python_end|>` wrapper."""
    text = text.strip()
    if text.startswith(START):
        text = text[len(START):]
        text = text[:-len(END)] if text.endswith(END) else text
    return text.strip()


def _arguments(call: ast.Call) -> dict[str, Any] | None:
    """The keyword arguments of `call` as JSON values; None if any is positional, `**`, repeated or not a
    literal JSON can hold (sets, bytes, complex numbers, infinities)."""
    if call.args or any(kw.arg is None for kw in call.keywords):
        return None
    arguments: dict[str, Any] = {}
    for kw in call.keywords:
        if kw.arg in arguments:
            return None
        try:
            arguments[str(kw.arg)] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        json.dumps(arguments, allow_nan=False)  # tuples become lists; anything else JSON lacks is refused
    except (TypeError, ValueError, RecursionError):
        return None
    return arguments


class PythonicParser(ToolCallParser):
    """A Python list of calls with literal keyword arguments, optionally inside `<|python_start|>` ...
    `<|python_end|>`. An output that is not such a list is content; it is read when the output ends (an output
    that starts like one is held until then, anything else streams at once)."""

    name = "pythonic"

    def consume(self, buffer: str, final: bool) -> tuple[list[Item], int]:
        head = buffer.lstrip()
        maybe_call = head.startswith(("[", START)) or START.startswith(head)
        if not final:
            return ([], 0) if maybe_call else ([buffer], len(buffer))
        return content_or_calls(buffer, self._calls(_unwrapped(head)) if maybe_call and head else None)

    @staticmethod
    def _calls(text: str) -> list[ParsedCall] | None:
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)):
                return None
            arguments = _arguments(node)
            if arguments is None:
                return None
            calls.append(ParsedCall(ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False)))
        return calls
