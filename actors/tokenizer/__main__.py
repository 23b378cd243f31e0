"""`python -m ringserve.actors.tokenizer`: run one tokenizer worker."""

from __future__ import annotations

import argparse

from ringserve.actors.common.runtime import add_bus_arguments, run_actor
from ringserve.actors.common.torch_threads import limit_torch_threads
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.tokenizer.chat_options import ChatOptions, add_chat_arguments


def build_parser(prog: str = "ringserve-tokenizer") -> argparse.ArgumentParser:
    """The tokenizer's flags (`ringserve worker --role tokenizer` takes the same)."""
    parser = argparse.ArgumentParser(prog=prog, description="ringserve tokenizer actor")
    add_bus_arguments(parser)
    parser.add_argument("--model", required=True, help="model name, .gguf file or model directory")
    parser.add_argument("--detokenizer-shards", type=int, default=1,
                        help="detokenizers the launcher starts (ids 0..N-1): chosen among until one has beat; "
                             "afterwards each request goes to one of the live detokenizers")
    add_chat_arguments(parser)  # --reasoning-parser, --chat-template, --generation-config, ...
    EngineConfig.add_argument(parser, "grammar_warm_up")  # its grammar checker's, as the scheduler's compiler's
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
                                                                args.grammar_warm_up))


if __name__ == "__main__":
    main()
