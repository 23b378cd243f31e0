"""`python -m ringserve.actors.tokenizer`: run one tokenizer worker."""

from __future__ import annotations

import argparse
from ringserve.actors.common.actor_flags import add_bus_arguments
from ringserve.actors.common.flag_fields import add_arguments
from ringserve.actors.common.help_format import DefaultOnceFormatter
from ringserve.actors.common.process_flags import TokenizerProcessFlags
from ringserve.actors.common.runtime import run_actor
from ringserve.actors.common.torch_threads import limit_torch_threads
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.tokenizer.chat_options import ChatFlags, ChatOptions


def build_parser(prog: str = "ringserve-tokenizer") -> argparse.ArgumentParser:
    """The tokenizer's flags (`ringserve worker --role tokenizer` takes the same)."""
    parser = argparse.ArgumentParser(prog=prog, description="ringserve tokenizer actor",
                                     formatter_class=DefaultOnceFormatter)
    add_bus_arguments(parser)
    for declared in (TokenizerProcessFlags, ChatFlags):  # ChatFlags: --reasoning-parser, --chat-template, ...
        add_arguments(declared, parser)
    EngineConfig.add_argument(parser, "grammar_warm_up")  # its grammar checker's, as the scheduler's compiler's
    EngineConfig.add_argument(parser, "context_length")  # it bounds requests as the scheduler does
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse flags and run a tokenizer worker until stopped."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.detokenizer_shards < 1:
        parser.error("--detokenizer-shards must be >= 1")
    try:
        options = ChatOptions.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    limit_torch_threads()
    from ringserve.actors.tokenizer.actor import tokenizer_main

    run_actor("tokenizer", args, lambda ctx: tokenizer_main(ctx, args.model, args.detokenizer_shards, options,
                                                                args.grammar_warm_up, args.context_length))


if __name__ == "__main__":
    main()
