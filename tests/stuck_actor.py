"""`python -m tests.stuck_actor --nats-url URL`: an actor whose stop hangs (its `on_stop` hook blocks the event
loop for two minutes), for the runtime's orphan test (tests/ring/test_actor_runtime.py)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ringserve.actors.common.actor_flags import add_bus_arguments
from ringserve.actors.common.runtime import ActorContext, run_actor

HANG_SECONDS = 120.0


async def stuck_main(ctx: ActorContext) -> dict[str, Any]:
    """Serve nothing; on stop, block as a close waiting on a dead NATS server or an import would."""

    async def hang() -> None:
        time.sleep(HANG_SECONDS)  # blocks the loop: no timeout of the runtime's can end it

    ctx.on_stop.append(hang)
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(prog="stuck-actor")
    add_bus_arguments(parser)
    args = parser.parse_args()
    run_actor("detokenizer", args, stuck_main)  # a role the bus knows; it subscribes nothing


if __name__ == "__main__":
    main()
