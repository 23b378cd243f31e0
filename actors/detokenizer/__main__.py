"""`python -m actors.detokenizer`: run the detokenizer for one shard."""

from __future__ import annotations

import argparse

from actors.common.runtime import add_bus_arguments, run_actor
from actors.common.torch_threads import limit_torch_threads


def main() -> None:
    """Parse flags and run the detokenizer actor until stopped."""
    parser = argparse.ArgumentParser(prog="ringserve-detokenizer", description="ringserve detokenizer actor")
    add_bus_arguments(parser)
    parser.add_argument("--model", required=True, help="model name, .gguf file or model directory")
    parser.add_argument("--shard", type=int, default=0, help="which `{ns}.tokens.{shard}` subject to serve")
    args = parser.parse_args()
    limit_torch_threads()
    from actors.detokenizer.actor import detokenizer_main

    run_actor("detokenizer", args, lambda ctx: detokenizer_main(ctx, args.model, args.shard), rank=args.shard)


if __name__ == "__main__":
    main()
