"""Command-line flags declared once, as the fields of a dataclass: the parser, the parsed values and the argv
that reproduces them all come from the fields.

A field is a flag when its metadata comes from `flag(help, group=..., aliases=..., **argparse keywords)`; other
fields (what a settings class computes or reads from the environment) are left alone. The flag is the field's
name with dashes (`max_live_requests` -> `--max-live-requests`), its default the field's default, and:

- a bool is a switch: `--flag` when off by default, `--flag/--no-flag` when on by default;
- `nargs` takes several values after one flag and over repeated flags (the field holds them all);
- `action="append"` takes one value per flag, repeatable;
- anything else takes one value, converted by `type` (the default's type unless given) before `choices`.

`add_arguments(cls, parser)` puts the flags in their help groups (`argument_group`; `add_exclusive_arguments`
for flags of which at most one is given), `from_args(cls, args)` reads them back into an instance, and
`to_argv(instance)` gives the flags that reproduce it on another process's command line (the launcher starting
an actor), each value written with `str` or the field's `to_text` (json.dumps for a JSON flag). Nothing here
imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterable, TypeVar

GROUP = "group"  # metadata keys that are ours, not argparse's
ALIASES = "aliases"
REQUIRED_IN_ARGV = "required"  # a required flag is always written, default or not
TO_TEXT = "to_text"  # how to_argv writes a value its `type` reads back (default: str), e.g. json.dumps
OWN_KEYS = (GROUP, ALIASES, TO_TEXT)

Parser = argparse.ArgumentParser | argparse._ArgumentGroup
T = TypeVar("T")


def flag(help: str, *, group: str = "", aliases: tuple[str, ...] = (), **argparse_kwargs: Any) -> dict[str, Any]:
    """A field's flag: its help, its `--help` group (empty: the class's), other spellings, argparse keywords
    (and `to_text`: how its value is written on a command line, when `str` is not what its `type` reads)."""
    return {"help": help, GROUP: group, ALIASES: tuple(aliases), **argparse_kwargs}


def flag_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of dataclass `cls` that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def option_name(f: dataclasses.Field[Any]) -> str:
    """The field's flag: `--` and its name with dashes."""
    return "--" + f.name.replace("_", "-")


def field_default(f: dataclasses.Field[Any]) -> Any:
    """The field's default value (a fresh one for a `default_factory`)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def argument_group(parser: argparse.ArgumentParser, title: str) -> Parser:
    """`parser`'s help group titled `title`, made on first use (so several declarations share one group);
    the parser itself for an empty title."""
    if not title:
        return parser
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def add_arguments(cls: type, parser: argparse.ArgumentParser, group: str = "",
                  names: Iterable[str] | None = None) -> None:
    """Add the flags of dataclass `cls` to `parser` (only those of `names` if given), each in its field's group
    or else in `group`."""
    wanted = None if names is None else set(names)
    for f in flag_fields(cls):
        if wanted is None or f.name in wanted:
            add_field_argument(argument_group(parser, f.metadata.get(GROUP) or group), f)


def add_exclusive_arguments(cls: type, parser: argparse.ArgumentParser, names: Iterable[str], group: str = "",
                            required: bool = False) -> None:
    """Add the flags of `names` (fields of dataclass `cls`) as mutually exclusive ones, listed in help group
    `group` (empty: the parser's own); one of them must be given if `required`."""
    wanted = set(names)
    exclusive = argument_group(parser, group).add_mutually_exclusive_group(required=required)
    for f in flag_fields(cls):
        if f.name in wanted:
            add_field_argument(exclusive, f)


def add_field_argument(parser: Parser, f: dataclasses.Field[Any]) -> argparse.Action:
    """One field's flag on `parser` (see the module's docstring for how its kind is chosen)."""
    names = [option_name(f), *f.metadata.get(ALIASES, ())]
    kwargs = {k: v for k, v in f.metadata.items() if k not in OWN_KEYS}
    default = field_default(f)
    if f.type in (bool, "bool") and default is True:
        action = parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=True, **kwargs)
        action.help = kwargs.get("help")  # without the "(default: True)" Python 3.9-3.12 append
        return action
    if f.type in (bool, "bool"):
        return parser.add_argument(*names, action="store_true", **kwargs)
    if "nargs" in kwargs:  # several values after one flag, and over repeated flags
        return parser.add_argument(*names, action="extend", type=str, default=[], **kwargs)
    if "action" in kwargs:  # "append", or an action of our own (cli_forms.OneOfSeveral)
        return parser.add_argument(*names, default=default, **kwargs)
    if default is not None:
        kwargs.setdefault("type", type(default))
    return parser.add_argument(*names, default=default, **kwargs)


def from_args(cls: type[T], args: argparse.Namespace, **others: Any) -> T:
    """The instance of dataclass `cls` the parsed flags describe (`others`: its fields that are not flags)."""
    return cls(**{f.name: getattr(args, f.name) for f in flag_fields(cls)}, **others)


def to_argv(settings: Any) -> list[str]:
    """The flags that reproduce the flag fields of dataclass instance `settings`: those that differ from the
    default (and the required ones), so the process that parses them gets the same values."""
    argv: list[str] = []
    for f in flag_fields(type(settings)):
        value = getattr(settings, f.name)
        if value == field_default(f) and not f.metadata.get(REQUIRED_IN_ARGV):
            continue
        name, text = option_name(f), f.metadata.get(TO_TEXT, str)
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        elif isinstance(value, (list, tuple)) and f.metadata.get("action") == "append":
            for item in value:
                argv += [name, text(item)]
        elif isinstance(value, (list, tuple)) and TO_TEXT not in f.metadata:  # several values after one flag
            argv += [name, *map(text, value)]
        elif value is not None:
            argv += [name, text(value)]
    return argv
