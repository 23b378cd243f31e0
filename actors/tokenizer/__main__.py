"""`python -m actors.tokenizer`: run one tokenizer worker."""

from __future__ import annotations

import argparse

from actors.common.runtime import add_bus_arguments, run_actor
from actors.common.torch_threads import limit_torch_threads


def main() -> None:
    """Parse flags and run a tokenizer worker until stopped."""
    parser = argparse.ArgumentParser(prog="ringserve-tokenizer", description="ringserve tokenizer actor")
    add_bus_arguments(parser)
    parser.add_argument("--model", required=True, help="model name, .gguf file or model directory")
    args = parser.parse_args()
    limit_torch_threads()
    from actors.tokenizer.actor import tokenizer_main

    run_actor("tokenizer", args, lambda ctx: tokenizer_main(ctx, args.model))


if __name__ == "__main__":
    main()
