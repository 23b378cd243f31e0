"""`python -m actors.scheduler`: run the scheduler of one tensor-parallel rank."""

from __future__ import annotations

import argparse
import os

from actors.common.runtime import add_bus_arguments, run_actor


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine sizing flags, shared with `ringserve serve`."""
    parser.add_argument("--max-total-tokens", type=int, default=32768,
                        help="KV cache size in tokens (all running requests together)")
    parser.add_argument("--max-prefill-tokens", type=int, default=8192,
                        help="prompt tokens prefilled per step at most (one longer prompt still runs alone)")
    parser.add_argument("--max-running-requests", type=int, default=256, help="requests decoding at once at most")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="threads for the scheduler's torch compute (0 = one per CPU core)")


def main() -> None:
    """Parse flags, set torch threads and run the scheduler actor until stopped."""
    parser = argparse.ArgumentParser(prog="ringserve-scheduler", description="ringserve scheduler actor")
    add_bus_arguments(parser)
    parser.add_argument("--model", required=True, help="model name, .gguf file or model directory")
    parser.add_argument("--rank", type=int, default=0, help="tensor-parallel rank")
    parser.add_argument("--detokenizer-shards", type=int, default=1, help="number of detokenizer shards")
    add_engine_arguments(parser)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.torch_threads or os.cpu_count() or 1)
    from actors.engine.engine import EngineConfig
    from actors.scheduler.actor import scheduler_main

    config = EngineConfig(max_total_tokens=args.max_total_tokens, max_prefill_tokens=args.max_prefill_tokens,
                          max_running_requests=args.max_running_requests)
    run_actor("scheduler", args, lambda ctx: scheduler_main(ctx, args.model, config, args.detokenizer_shards),
              rank=args.rank)


if __name__ == "__main__":
    main()
