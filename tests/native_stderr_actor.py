"""`python -m tests.native_stderr_actor --nats-url URL [--crash]`: an actor that writes to file descriptor 2 as
native code does (a forged log line with control characters, then a 1 MB flood in one write made while holding
the GIL, as a C++ library's warning would be), then reports ready; with `--crash`, its main raises an exception
whose message forges a line instead. For tests/observability/test_log_safety.py."""

from __future__ import annotations

import argparse
import ctypes
import os
from typing import Any

from ringserve.actors.common.actor_flags import add_bus_arguments
from ringserve.actors.common.runtime import ActorContext, run_actor

FORGED = "22:40:00.000 ERROR [launcher] FORGED-native password=hunter2"
FLOOD_LINES, FLOOD_LINE_BYTES = 128, 8000
FLOOD_END = "end-of-flood"


def write_natively() -> None:
    """What a C/C++ library prints: straight to descriptor 2, the flood without releasing the GIL."""
    os.write(2, f"zzz\n{FORGED}\rOVERWRITE \x1b[2K\x1b[31mred\n".encode())
    flood = (b"y" * (FLOOD_LINE_BYTES - 1) + b"\n") * FLOOD_LINES + FLOOD_END.encode() + b"\n"
    written = ctypes.PyDLL(None).write(2, flood, len(flood))  # PyDLL: the GIL stays held during the call
    assert written == len(flood), written


async def noisy_main(ctx: ActorContext, crash: bool) -> dict[str, Any]:
    """Write natively, then serve nothing (or raise, with `crash`)."""
    if crash:
        raise ValueError(f"bad value 'q\n{FORGED.replace('native', 'traceback')}'")
    write_natively()
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(prog="native-stderr-actor")
    add_bus_arguments(parser)
    parser.add_argument("--crash", action="store_true")
    args = parser.parse_args()
    run_actor("detokenizer", args, lambda ctx: noisy_main(ctx, args.crash))  # a role the bus knows


if __name__ == "__main__":
    main()
