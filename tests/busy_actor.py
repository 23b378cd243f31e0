"""`python -m tests.busy_actor --nats-url URL --rank N`: an actor whose event loop is busy on purpose, for the
heartbeat tests (tests/ring/test_liveness_heartbeat.py).

Once ready it blocks its own event loop, first with `time.sleep(BLOCK_SECONDS)` (a loop doing long synchronous
work), then with our C++ float32 linear run repeatedly on the loop's thread for about as long (a long torch op),
then serves idly until stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from ringserve.actors.common.actor_flags import add_bus_arguments
from ringserve.actors.common.runtime import ActorContext, run_actor

BLOCK_SECONDS = 4.0


def long_torch_op(seconds: float) -> int:
    """Run `ringserve.kernels.cpu`'s f32 linear (the torch fallback without the library) for about `seconds`; the calls."""
    import torch

    import ringserve.kernels.cpu as cpu_kernels

    torch.set_num_threads(1)
    x, weight = torch.randn(2048, 1024), torch.randn(2048, 1024)
    op = cpu_kernels.f32_linear() if cpu_kernels.compiled() else (lambda a, w, b: torch.nn.functional.linear(a, w))
    calls, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        op(x, weight, None)
        calls += 1
    return calls


async def busy_main(ctx: ActorContext) -> dict[str, Any]:
    """Block the loop twice after a moment (sleep, then a long torch op)."""
    import ringserve.kernels.cpu  # noqa: F401  (imported and built before ready: the blocking is the op, not the import)

    async def block() -> None:
        await asyncio.sleep(1.0)
        time.sleep(BLOCK_SECONDS)
        await asyncio.sleep(0)
        long_torch_op(BLOCK_SECONDS)

    ctx.on_stop.append(_nothing)
    asyncio.get_running_loop().create_task(block())
    return {}


async def _nothing() -> None:
    return None


def main() -> None:
    """Parse the bus flags and run the busy actor as a detokenizer of `--rank`."""
    parser = argparse.ArgumentParser(prog="busy-actor")
    add_bus_arguments(parser)
    parser.add_argument("--rank", type=int, default=9)
    args = parser.parse_args()
    run_actor("detokenizer", args, busy_main, rank=args.rank)  # a role the bus knows; it subscribes nothing


if __name__ == "__main__":
    main()
