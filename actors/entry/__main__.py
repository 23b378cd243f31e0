"""`python -m ringserve.actors.entry`: run the HTTP entry (API key from the environment: RINGSERVE_API_KEY)."""

from __future__ import annotations

import argparse
from ringserve.actors.common.actor_flags import add_bus_arguments
from ringserve.actors.common.flag_fields import add_arguments
from ringserve.actors.common.help_format import DefaultOnceFormatter
from ringserve.actors.common.process_flags import EntryProcessFlags
from ringserve.actors.common.runtime import run_actor
from ringserve.actors.entry.settings import EntrySettings, add_entry_arguments


def build_parser(prog: str = "ringserve-entry") -> argparse.ArgumentParser:
    """The entry's flags (`ringserve worker --role entry` takes the same)."""
    parser = argparse.ArgumentParser(prog=prog, description="ringserve HTTP entry actor",
                                     formatter_class=DefaultOnceFormatter)
    add_bus_arguments(parser)
    add_arguments(EntryProcessFlags, parser)
    add_entry_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse flags and run the HTTP entry actor until stopped."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = EntrySettings.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    from ringserve.actors.entry.actor import entry_main

    run_actor("entry", args, lambda ctx: entry_main(ctx, settings))


if __name__ == "__main__":
    main()
