"""`python -m ringserve.actors.scheduler`: run the scheduler of one tensor-parallel rank.

Before anything else it guards its process group (actors/scheduler/process_group.py: no compile subprocess
outlives it), and rank 0 claims its replica id on the bus (bus/replica_claim.py): `--dp-replica-id N` or, left
out, the lowest free id. A claim it cannot get ends it with exit 2 before the model loads.
"""

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
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from typing import Any, Awaitable, Callable, NoReturn  # noqa: E402

from ringserve.actors.common.actor_flags import add_bus_arguments, credentials_from_args  # noqa: E402
from ringserve.actors.common.flag_fields import add_arguments, from_args  # noqa: E402
from ringserve.actors.common.help_format import DefaultOnceFormatter  # noqa: E402
from ringserve.actors.common.process_flags import SchedulerProcessFlags  # noqa: E402
from ringserve.actors.common.runtime import ActorContext, exit_now, run_actor  # noqa: E402
from ringserve.actors.engine.config import EngineConfig  # noqa: E402
from ringserve.actors.scheduler.admission import AdmissionFlags  # noqa: E402
from ringserve.actors.scheduler.process_group import guard_process_group  # noqa: E402
from ringserve.actors.scheduler.tp_follower import TensorParallelFlags, check_tp_args  # noqa: E402
from ringserve.bus.permissions import inbox_prefix  # noqa: E402
from ringserve.bus.replica_claim import ClaimError, JetStreamUnavailable, ReplicaClaim, describe  # noqa: E402
from ringserve.bus.subjects import Subjects  # noqa: E402
from ringserve.observability.logging import log_event  # noqa: E402

CLAIM_REFUSED = 2  # the exit code when the replica id is held by a live replica (or none is free)


def build_parser(prog: str = "ringserve-scheduler") -> argparse.ArgumentParser:
    """The scheduler's flags (`ringserve worker --role scheduler` takes the same)."""
    parser = argparse.ArgumentParser(prog=prog, description="ringserve scheduler actor",
                                     formatter_class=DefaultOnceFormatter)
    add_bus_arguments(parser)
    for declared in (SchedulerProcessFlags, TensorParallelFlags, AdmissionFlags, EngineConfig):
        add_arguments(declared, parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse flags, set torch threads and run the scheduler actor until stopped."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = EngineConfig.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.dp_replica_id is None and args.tp > 1:
        parser.error("--tp > 1: give every rank of the replica its --dp-replica-id")
    problem = check_tp_args(args)
    if problem is not None:
        parser.error(problem)
    guard_process_group()  # before anything starts a subprocess
    claim = claim_replica_id(args) if args.rank == 0 else None
    if args.tp > 1 and config.torch_threads == 0 and config.resolved_device() == "cpu":
        # the replica's ranks share this host's cores: each takes its part, fixed (a tuner per rank would
        # measure the others' load)
        config = dataclasses.replace(config, torch_threads=max(1, (os.cpu_count() or 1) // args.tp))

    import torch

    from ringserve.actors.engine.runner.graphs.thread_tuner import startup_threads

    torch.set_num_threads(startup_threads(config))
    from ringserve.actors.scheduler.actor import scheduler_main
    from ringserve.actors.scheduler.tp_follower import follower_main, follower_rank, leader_main

    admission = from_args(AdmissionFlags, args).admission()
    if args.tp == 1:
        run_actor("scheduler", args, releasing(claim, lambda ctx: scheduler_main(ctx, args.model, config, admission)),
                  rank=args.dp_replica_id)
    elif args.rank == 0:
        run_actor("scheduler", args, releasing(claim, lambda ctx: leader_main(ctx, args.model, config, admission,
                                                                              args)),
                  rank=args.dp_replica_id)
    else:
        run_actor("scheduler", args, lambda ctx: follower_main(ctx, args.model, config, args),
                  rank=follower_rank(args.dp_replica_id, args.rank))


def claim_replica_id(args: argparse.Namespace) -> ReplicaClaim | None:
    """Claim `args.dp_replica_id` (None: the lowest free id) and set it to the id claimed; exits 2 when it is
    held by a live replica, 1 when NATS cannot be asked. None where the NATS server has no JetStream and an id
    was given: it runs unclaimed, as before claims (a warning says so)."""
    subjects = Subjects(args.namespace)
    try:
        claim = ReplicaClaim.acquire(args.nats_url, subjects, args.dp_replica_id, credentials_from_args(args),
                                     inbox_prefix(args.namespace, "scheduler"), on_lost=_lost)
    except JetStreamUnavailable as exc:
        if args.dp_replica_id is None:
            _refuse(f"a scheduler without --dp-replica-id claims the lowest free id on the bus, but {exc}; give it "
                    "--dp-replica-id, or turn JetStream on", CLAIM_REFUSED)
        print(f"ringserve scheduler: {exc}: replica id {args.dp_replica_id} is not claimed (two replicas could "
              "share it)", file=sys.stderr)
        return None
    except ClaimError as exc:
        _refuse(f"{exc} (namespace {args.namespace!r})", CLAIM_REFUSED)
    except Exception as exc:  # no NATS there, refused or unreadable credentials, no answer from JetStream
        hint = ("" if isinstance(exc, ConnectionError) else " (no answer from JetStream: is it up, and may this "
                "user use the claims bucket? credentials written before replica claims lack it: write them again "
                "with `ringserve nats-config`)")
        _refuse(f"could not claim a replica id on NATS {args.nats_url}: {exc!r}{hint}", 1)
    args.dp_replica_id = claim.replica
    print(f"ringserve scheduler: claimed replica id {claim.replica} in namespace {args.namespace!r}", file=sys.stderr)
    return claim


def _refuse(message: str, code: int) -> NoReturn:
    print(f"ringserve scheduler: {message}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown: nothing is open but the claim thread's connection


def _lost(holder: dict[str, Any]) -> None:
    """Another process holds this replica's id now: stop at once, so only one serves it."""
    log_event(logging.getLogger("actor"), logging.CRITICAL, "replica id claimed by another process; exiting",
              holder=describe(holder))
    exit_now(1)


def releasing(claim: ReplicaClaim | None, main: Callable[[ActorContext], Awaitable[dict[str, Any]]]
              ) -> Callable[[ActorContext], Awaitable[dict[str, Any]]]:
    """`main` with the claim released (its key deleted) when the actor stops."""
    if claim is None:
        return main

    async def release() -> None:
        await asyncio.to_thread(claim.release)

    def claimed_main(ctx: ActorContext) -> Awaitable[dict[str, Any]]:
        ctx.on_stop.append(release)
        return main(ctx)

    return claimed_main


if __name__ == "__main__":
    main()
