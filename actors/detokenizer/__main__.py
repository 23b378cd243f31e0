"""`python -m ringserve.actors.detokenizer`: run one detokenizer (its id: `--shard`)."""

from __future__ import annotations

import argparse
from ringserve.actors.common.actor_flags import add_bus_arguments
from ringserve.actors.common.flag_fields import add_arguments
from ringserve.actors.common.help_format import DefaultOnceFormatter
from ringserve.actors.common.process_flags import DetokenizerProcessFlags
from ringserve.actors.common.runtime import run_actor
from ringserve.actors.common.torch_threads import limit_torch_threads


def build_parser(prog: str = "ringserve-detokenizer") -> argparse.ArgumentParser:
    """The detokenizer's flags (`ringserve worker --role detokenizer` takes the same)."""
    parser = argparse.ArgumentParser(prog=prog, description="ringserve detokenizer actor",
                                     formatter_class=DefaultOnceFormatter)
    add_bus_arguments(parser)
    add_arguments(DetokenizerProcessFlags, parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse flags and run the detokenizer actor until stopped."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.shard < 0:
        parser.error("--shard must be >= 0")
    limit_torch_threads()
    from ringserve.actors.detokenizer.actor import detokenizer_main

    run_actor("detokenizer", args, lambda ctx: detokenizer_main(ctx, args.model, args.shard), rank=args.shard)


if __name__ == "__main__":
    main()
