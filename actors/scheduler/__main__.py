"""`python -m actors.scheduler`: run the scheduler of one tensor-parallel rank."""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. On a small machine the other actors
# need those cycles, and a spinning or preempted team member stalls every parallel region (measured under
# load: 806 ms per batch-1 decode step with spinning threads, 172 ms with passive ones).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402

from actors.common.runtime import add_bus_arguments, run_actor  # noqa: E402
from actors.engine.config import EngineConfig  # noqa: E402
from actors.scheduler.admission import add_admission_arguments, admission_from_args  # noqa: E402


def main() -> None:
    """Parse flags, set torch threads and run the scheduler actor until stopped."""
    parser = argparse.ArgumentParser(prog="ringserve-scheduler", description="ringserve scheduler actor",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_bus_arguments(parser)
    parser.add_argument("--model", required=True, help="model name, .gguf file or model directory")
    parser.add_argument("--rank", type=int, default=0, help="tensor-parallel rank (only 0: no tensor parallelism yet)")
    parser.add_argument("--dp-replica-id", type=int, default=0,
                        help="this scheduler replica's id (`--dp`): its subject, heartbeat and server-info entry")
    parser.add_argument("--detokenizer-shards", type=int, default=1, help="number of detokenizer shards")
    add_admission_arguments(parser)
    EngineConfig.add_arguments(parser)
    args = parser.parse_args()
    try:
        config = EngineConfig.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))

    import torch

    from actors.engine.thread_tuner import startup_threads

    torch.set_num_threads(startup_threads(config))
    from actors.scheduler.actor import scheduler_main

    if args.rank != 0:
        parser.error("tensor parallelism is not implemented: --rank must be 0")
    admission = admission_from_args(args)
    run_actor("scheduler", args,
              lambda ctx: scheduler_main(ctx, args.model, config, args.detokenizer_shards, admission), rank=args.dp_replica_id)


if __name__ == "__main__":
    main()
