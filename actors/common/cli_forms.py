"""Argparse forms for the flag spellings vLLM's and SGLang's users paste: a flag those servers let take several
values where ringserve serves one, and flags ringserve refuses with a message saying what to pass instead.

Both are argparse actions, so the refusal comes from the parser itself (`ringserve serve: error: argument
--api-key: ...`, or a ValueError from `serve_args`), before anything is loaded.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence


class OneOfSeveral(argparse.Action):
    """A flag that takes one value, spelled as vLLM's several-value form (`nargs="+"`): one value is taken, more
    (after one flag or over repeated flags) are an error ending with `refusal` (what to pass instead)."""

    def __init__(self, option_strings: Sequence[str], dest: str, refusal: str = "pass one", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="+", **kwargs)
        self.refusal = refusal

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        earlier = getattr(namespace, self.dest, self.default)
        if earlier not in (None, self.default):  # given twice: as several names
            values = [earlier, *values]
        if len(values) > 1:
            raise argparse.ArgumentError(self, f"got {len(values)} values ({', '.join(map(str, values))}); "
                                               f"{self.refusal}")
        setattr(namespace, self.dest, values[0])


class Refused(argparse.Action):
    """A flag another server takes and ringserve does not: giving it (with or without a value) is an error whose
    message is `instead`. It never appears in the parsed namespace."""

    def __init__(self, option_strings: Sequence[str], dest: str, instead: str = "", **kwargs: Any) -> None:
        kwargs.setdefault("default", argparse.SUPPRESS)
        super().__init__(option_strings, dest, nargs="?", **kwargs)
        self.instead = instead

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        raise argparse.ArgumentError(self, self.instead)


def add_refused(parser: argparse.ArgumentParser | Any, flag: str, instead: str) -> None:
    """Declare `flag` as refused with the message `instead` (also its help, so `--help` and the docs say it)."""
    parser.add_argument(flag, action=Refused, instead=instead, metavar="VALUE", help=f"not taken: {instead}")
