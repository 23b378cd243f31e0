"""`python -m actors.entry`: run the HTTP entry."""

from __future__ import annotations

import argparse

from actors.common.runtime import add_bus_arguments, run_actor


def main() -> None:
    """Parse flags and run the HTTP entry actor until stopped."""
    parser = argparse.ArgumentParser(prog="ringserve-entry", description="ringserve HTTP entry actor")
    add_bus_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", required=True, help="model id shown in /v1/models")
    args = parser.parse_args()
    from actors.entry.actor import entry_main

    run_actor("entry", args, lambda ctx: entry_main(ctx, args.host, args.port, args.served_model_name))


if __name__ == "__main__":
    main()
