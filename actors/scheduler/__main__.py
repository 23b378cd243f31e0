"""`python -m actors.scheduler`: run the scheduler of one tensor-parallel rank."""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP threads spin only briefly, then sleep. On a small machine the other
# actors need those cycles, and a spinning or preempted team member stalls every parallel region (measured under
# load: 806 ms per batch-1 decode step with libgomp's default 3 ms of spinning, 172 ms with none). With none
# (OMP_WAIT_POLICY=PASSIVE) every op of a step waits for its workers to wake, though: a batch-1 `gguf` step on
# two threads took 24-35 ms against 8.7-11 ms with 3000 spins (~30 us; docs/benchmarks.md).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")

import argparse  # noqa: E402
import dataclasses  # noqa: E402

from actors.common.runtime import add_bus_arguments, run_actor  # noqa: E402
from actors.engine.config import EngineConfig  # noqa: E402
from actors.scheduler.admission import add_admission_arguments, admission_from_args  # noqa: E402
from actors.scheduler.tp_follower import add_tp_arguments, check_tp_args  # noqa: E402


def build_parser(prog: str = "ringserve-scheduler") -> argparse.ArgumentParser:
    """The scheduler's flags (`ringserve worker --role scheduler` takes the same)."""
    parser = argparse.ArgumentParser(prog=prog, description="ringserve scheduler actor",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_bus_arguments(parser)
    parser.add_argument("--model", required=True, help="model name, .gguf file or model directory")
    parser.add_argument("--rank", type=int, default=0,
                        help="this process's tensor-parallel rank in its replica: 0 reads NATS and schedules, "
                             "1..tp-1 run rank 0's step plans (actors/scheduler/tp_follower.py)")
    add_tp_arguments(parser)
    parser.add_argument("--dist-init-addr", default="", metavar="HOST:PORT",
                        help="with --tp > 1: where rank 0 of this replica listens for its other ranks (the same "
                             "for every rank of the replica)")
    parser.add_argument("--dp-replica-id", type=int, default=0,
                        help="this scheduler replica's id (`--dp`): its subject, heartbeat and server-info entry")
    add_admission_arguments(parser)
    EngineConfig.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse flags, set torch threads and run the scheduler actor until stopped."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = EngineConfig.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    problem = check_tp_args(args)
    if problem is not None:
        parser.error(problem)
    if args.tp > 1 and config.torch_threads == 0 and config.resolved_device() == "cpu":
        # the replica's ranks share this host's cores: each takes its part, fixed (a tuner per rank would
        # measure the others' load)
        config = dataclasses.replace(config, torch_threads=max(1, (os.cpu_count() or 1) // args.tp))

    import torch

    from actors.engine.thread_tuner import startup_threads

    torch.set_num_threads(startup_threads(config))
    from actors.scheduler.actor import scheduler_main
    from actors.scheduler.tp_follower import follower_main, follower_rank, leader_main

    admission = admission_from_args(args)
    if args.tp == 1:
        run_actor("scheduler", args,
                  lambda ctx: scheduler_main(ctx, args.model, config, admission), rank=args.dp_replica_id)
    elif args.rank == 0:
        run_actor("scheduler", args, lambda ctx: leader_main(ctx, args.model, config, admission, args),
                  rank=args.dp_replica_id)
    else:
        run_actor("scheduler", args, lambda ctx: follower_main(ctx, args.model, config, args),
                  rank=follower_rank(args.dp_replica_id, args.rank))


if __name__ == "__main__":
    main()
