"""What a constraint is: a `GrammarSpec` (its kind and source, the compile cache's key) and the `GrammarError` that
says why one cannot be used."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json_object", "json_schema", "regex", "ebnf", "structural_tag"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")


class GrammarError(ValueError):
    """A constraint that cannot be used: the message says what is wrong, fit for a 400 reply."""

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


class UnreachableTag(GrammarError):
    """A structural tag whose trigger or tag text holds one of the model's special tokens: no grammar produces a
    special token (the vocabulary the backend sees blanks them), so the tag could never be entered."""


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint: `kind` and its `source` (a JSON schema text, a regex, an EBNF grammar with `root`, a structural
    tag's JSON text).

    `json_object` (any JSON object) takes no source. Specs are hashable and compare by value: the cache key.
    """

    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if not isinstance(self.source, str):
            raise GrammarError(f"{self.kind} must be a string, not {type(self.source).__name__}", self.kind)
        if self.kind == "json_object" and self.source:
            raise GrammarError("json_object takes no source", self.kind)
