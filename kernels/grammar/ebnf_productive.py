"""Finding grammar rules that no finite text matches, in xgrammar's printed grammar (`str(Grammar)`).

`root ::= "x" | "y" loop` with `loop ::= "a" loop` compiles, and after "y" the text the grammar forces
(jump-forward) is "aaa..." without end: computing it grows memory until the process dies. A rule is
*productive* when some finite text matches it (a string or character class, an empty alternative, a starred
or optional part, a sequence of productive parts); a rule reachable from `root` that is not productive can only
be entered, never finished. The check reads xgrammar's normalized text of every constraint (JSON schemas and
regexes become such grammars too), so it sees what the engine will run. Anything it cannot read ends the check
with no verdict: it can miss a grammar, never refuse a good one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])'
                    r'|(?P<rep>\{\s*-?\d+\s*(?:,\s*-?\d+\s*)?\})|(?P<look>\(=)|(?P<name>[A-Za-z_][\w.\-]*)'
                    r'|(?P<op>[()|*+?]))')
_RULE = re.compile(r"^([A-Za-z_][\w.\-]*) ::= (.*)$")


class Unreadable(ValueError):
    """The grammar text has a form this reader does not know."""


@dataclass
class _Node:
    """An expression: `alts` (a choice of sequences), a rule `ref`, or a terminal (neither)."""

    alts: list[list[_Node]] | None = None
    ref: str | None = None


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None or match.end() == pos:
                raise Unreadable(text[pos:pos + 40])
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            pos = match.end()
        self.at = 0

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.at] if self.at < len(self.tokens) else ("end", "")

    def take(self) -> tuple[str, str]:
        token = self.peek()
        self.at += 1
        return token

    def choice(self) -> _Node:
        alts = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.take()
            alts.append(self.sequence())
        return _Node(alts=alts)

    def sequence(self) -> list[_Node]:
        items: list[_Node] = []
        while self.peek()[0] != "end" and self.peek() not in (("op", "|"), ("op", ")")):
            item = self.item()
            if item is not None:
                items.append(item)
        return items

    def item(self) -> _Node | None:
        kind, text = self.take()
        if kind == "look":  # a lookahead matches no text of its own
            self.choice()
            self.close()
            return None
        if kind in ("str", "cls"):
            node = _Node()
        elif kind == "name":
            node = _Node(ref=text)
        elif (kind, text) == ("op", "("):
            node = self.choice()
            self.close()
        else:
            raise Unreadable(text)
        while self.peek()[0] == "rep" or self.peek() in (("op", "*"), ("op", "?"), ("op", "+")):
            kind, text = self.take()
            # `*`, `?`, `{0, n}`: matching it zero times is finite
            if text in ("*", "?") or (kind == "rep" and re.match(r"\{\s*0\s*[,}]", text)):
                node = _Node(alts=[[node], []])
        return node

    def close(self) -> None:
        if self.take() != ("op", ")"):
            raise Unreadable("unbalanced parentheses")


def _productive(node: _Node, known: set[str]) -> bool:
    if node.ref is not None:
        return node.ref in known
    if node.alts is None:
        return True
    return any(all(_productive(item, known) for item in alt) for alt in node.alts)


def _refs(node: _Node, out: set[str]) -> set[str]:
    if node.ref is not None:
        out.add(node.ref)
    for alt in node.alts or ():
        for item in alt:
            _refs(item, out)
    return out


def unproductive_rule(grammar_text: str, root: str = "root") -> str | None:
    """The name of a rule reachable from `root` that no finite text matches, or None (also when the text is
    not in a form this reader knows)."""
    try:
        rules: dict[str, _Node] = {}
        for line in grammar_text.splitlines():
            if line.strip():
                match = _RULE.match(line)
                if match is None:
                    return None
                parser = _Parser(match.group(2))
                rules[match.group(1)] = parser.choice()
                if parser.peek()[0] != "end":
                    return None
    except (Unreadable, RecursionError):
        return None
    # a name no line defines (none in xgrammar's output, but unknown is not unproductive) counts as productive
    known = {ref for body in rules.values() for ref in _refs(body, set())} - set(rules)
    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            if name not in known and _productive(body, known):
                known.add(name)
                changed = True
    reachable, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in reachable or name not in rules:
            continue
        reachable.add(name)
        todo += _refs(rules[name], set())
    bad = sorted(reachable - known, key=lambda name: (name != root, len(name), name))
    return bad[0] if bad else None
