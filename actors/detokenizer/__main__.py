"""`python -m ringserve.actors.detokenizer`: run one detokenizer (its id: `--shard`)."""

from __future__ import annotations

import argparse

from ringserve.actors.common.runtime import add_bus_arguments, run_actor
from ringserve.actors.common.torch_threads import limit_torch_threads


def build_parser(prog: str = "ringserve-detokenizer") -> argparse.ArgumentParser:
    """The detokenizer's flags (`ringserve worker --role detokenizer` takes the same)."""
    parser = argparse.ArgumentParser(prog=prog, description="ringserve detokenizer actor")
    add_bus_arguments(parser)
    parser.add_argument("--model", required=True, help="model name, .gguf file or model directory")
    parser.add_argument("--shard", type=int, default=0,
                        help="this detokenizer's id: it serves `{ns}.tokens.{shard}`, and tokenizers choose it for new "
                             "requests from its heartbeats")
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
