"""Scheduler processes of a tensor-parallel replica (`--tp N`): rank 0's engine, and the follower ranks' loop.

A replica of `--tp N` is N scheduler processes joined by torch.distributed at `--dist-init-addr` (rank 0
listens there; the launcher picks a free loopback port per replica). Rank 0 is the ordinary scheduler actor
(it alone reads NATS, schedules, samples and publishes) over a `TPEngine`; ranks 1..N-1 run `follower_main`:
they load the model, keep their shard, and run rank 0's step plans in a thread (actors/engine/scheduling/tp_engine.py).

Naming: every rank heartbeats as role `scheduler`; rank 0 with the replica id (`--dp-replica-id`), so routing,
`/get_server_info` and metrics see one replica, and a follower with `follower_rank(replica, k)` =
`replica + TP_RANK_STRIDE * k` (`scheduler1000` is rank 1 of replica 0); only rank 0's beats carry a
`ReplicaLoad`. A follower reports rank 0's live request count as its own, and told to drain it waits for rank 0
to finish draining and say stop.

Failure: a follower whose rank 0 is gone or silent past the collective timeout (`--tp-timeout`) exits 1;
rank 0 whose follower fails ends its requests with errors and exits 1 (`TPEngine`); the supervisor restarts
the replica's ranks together, or fail-stops when it was the last replica.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from ringserve.actors.common.flag_fields import flag
from ringserve.actors.common.help_format import SCALE_OUT
from ringserve.actors.engine.parallel.tp_checks import DEFAULT_TIMEOUT_S

TP_RANK_STRIDE = 1000  # a follower's actor rank: replica id + this * its tensor-parallel rank
log = logging.getLogger("scheduler")


@dataclass
class TensorParallelFlags:
    """`--tp`, `--tp-timeout` and `--ep`, declared once: `ringserve serve` and the scheduler take them."""

    tp: int = field(default=1, metadata=flag(
        "tensor-parallel ranks per scheduler replica: one scheduler process per rank, each with 1/tp of the attention "
        "heads and MLP (heads must divide by it)", group=SCALE_OUT, aliases=("--tensor-parallel-size", "--tp-size")))
    tp_timeout: float = field(default=DEFAULT_TIMEOUT_S, metadata=flag(
        "with --tp > 1: seconds any collective between the ranks may take; a rank that died or hangs fails its "
        "replica's requests after at most this long", group=SCALE_OUT, metavar="SECONDS"))
    ep: int = field(default=1, metadata=flag(
        "expert parallelism for mixture-of-experts models: with --ep equal to --tp, each rank holds whole experts "
        "(1/ep of them) instead of a slice of every expert; attention stays split by heads (1: experts sliced like "
        "the MLP)", group=SCALE_OUT))


def follower_rank(replica: int, tp_rank: int) -> int:
    """The actor rank (heartbeat, ready, supervisor name) of tensor-parallel rank `tp_rank` of `replica`."""
    return replica if tp_rank == 0 else replica + TP_RANK_STRIDE * tp_rank


def check_tp_args(args: argparse.Namespace) -> str | None:
    """Why the scheduler's tensor-parallel flags do not fit together, or None."""
    if args.tp < 1:
        return f"--tp must be at least 1, got {args.tp}"
    if not 0 <= args.rank < args.tp:
        return f"--rank must be in [0, --tp {args.tp}), got {args.rank}"
    if args.tp > 1 and not args.dist_init_addr:
        return "--tp > 1 needs --dist-init-addr host:port (where rank 0 of the replica listens)"
    if args.ep != 1 and args.ep != args.tp:
        return f"--ep must be 1 or equal to --tp ({args.tp}): experts are placed over the tensor-parallel ranks, got {args.ep}"
    if not args.tp_timeout > 0:
        return f"--tp-timeout must be > 0, got {args.tp_timeout}"
    if args.tp > 1 and args.dp_replica_id >= TP_RANK_STRIDE:
        return f"--dp-replica-id must be below {TP_RANK_STRIDE} with --tp"
    return None


def _load_rank(model: str, config: Any, args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """Join the replica's group, load the model and keep this rank's shard: (group, model, config, source)."""
    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.engine.scheduling.engine_core import DTYPES
    from ringserve.actors.engine.execution_plan import resolve_execution
    from ringserve.actors.engine.parallel.tensor_parallel import init_group
    from ringserve.actors.engine.scheduling.tp_engine import prepare_rank
    from ringserve.actors.engine.models.weights import load_model

    source = resolve_model(model)
    group = init_group(args.rank, args.tp, args.dist_init_addr, config.resolved_device(), args.tp_timeout)
    loaded = load_model(source, DTYPES[config.resolved_dtype()], config.resolved_device(), resolve_execution(config))
    return group, loaded, prepare_rank(loaded, config, group, expert_parallel=args.ep > 1, source=source), source


async def leader_main(ctx: Any, model: str, config: Any, admission: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0: the scheduler actor over a `TPEngine` of the whole replica."""
    from ringserve.actors.common.text_tokenizer import load_text_model
    from ringserve.actors.engine.scheduling.tp_engine import TPEngine
    from ringserve.actors.engine.scheduling.engine_core import EngineCore
    from ringserve.actors.engine.speculative.draft_model import load_draft_engine
    from ringserve.actors.scheduler.actor import scheduler_main
    from ringserve.actors.scheduler.engine_thread import on_engine_thread

    loop = asyncio.get_running_loop()

    def build() -> TPEngine:  # on the thread that will run its steps (actors/scheduler/engine_thread.py)
        group, llama, rank_config, source = _load_rank(model, config, args)
        tokenizer = load_text_model(source).tokenizer
        # the draft model runs whole on rank 0 alone (it drafts for the group), eagerly as the ranks do
        draft = (load_draft_engine(EngineCore, rank_config, tokenizer) if rank_config.speculative_algorithm == "draft"
                 else None)
        return TPEngine(llama, rank_config, group, tokenizer, source.name,
                        on_broken=lambda why: loop.call_soon_threadsafe(ctx.fail, why), draft=draft)

    engine = await on_engine_thread(build)

    async def close() -> None:
        await loop.run_in_executor(None, engine.close)

    ctx.on_stop.append(close)
    detail = await scheduler_main(ctx, model, config, admission, engine=engine)
    return {**detail, "tp_size": args.tp, "tp_rank": 0}


async def follower_main(ctx: Any, model: str, config: Any, args: argparse.Namespace) -> dict[str, Any]:
    """A follower rank: run rank 0's plans in a thread until rank 0 says stop (exit 0) or is gone (exit 1)."""
    from ringserve.actors.engine.scheduling.tp_engine import TPFollower
    from ringserve.actors.scheduler.engine_thread import on_passing_thread

    def load() -> TPFollower:  # on a thread that ends with it: the steps run on the follower's own thread
        group, llama, rank_config, _ = _load_rank(model, config, args)
        return TPFollower(llama, rank_config, group)

    follower = await on_passing_thread(load, name="tp-load")
    ctx.live_rids = lambda: follower.live
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def finish(failure: str | None) -> None:
        if not ended.done():
            ended.set_result(None)
        if failure is not None:
            ctx.fail(failure)
        else:
            ctx.stopping.set()

    def run() -> None:
        try:
            follower.run(ctx.stopping.is_set)
        except Exception as exc:  # rank 0 gone or stopped, or a plan this rank cannot run
            log.exception("tensor-parallel follower stopped")
            loop.call_soon_threadsafe(finish, f"tensor-parallel rank {args.rank} stopped: {exc!r}"[:500])
        else:
            loop.call_soon_threadsafe(finish, None)

    async def wait_for_rank0() -> None:
        """Draining: rank 0 drains too and then says stop; wait for that (at most --drain-timeout)."""
        try:
            await asyncio.wait_for(asyncio.shield(ended), args.drain_timeout)
        except asyncio.TimeoutError:
            pass

    ctx.on_drain.append(wait_for_rank0)
    # a daemon thread: a follower told to stop at once does not wait for a collective that may never come
    threading.Thread(target=run, name="tp-follower", daemon=True).start()
    return {"tp_size": args.tp, "tp_rank": args.rank, "replica": args.dp_replica_id}
