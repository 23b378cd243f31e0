"""Scheduler actor (one per tensor-parallel rank; rank 0 reads the bus).

Loop: apply what arrived (new requests, aborts, control commands) -> one engine step in a worker thread, so
the bus stays responsive during the forward pass -> publish that step's token rows, one message per
detokenizer (each request's rows go to the detokenizer stamped on its TokenizedRequest; with
`--stream-interval` k, a request's rows are joined k tokens at a time first, and a non-streamed one's more:
stream_interval.py). The engine is touched only between steps, from this loop, so it needs no locks, and only
through `EngineInterface`: its rows are already the wire's `TokenRow`s. When the engine falls idle the loop
calls its `on_idle` once.

Admission (`admission.py`): every request arrives here, from HTTP and from NATS clients alike, so the caps on
live requests (in total, and per NATS client by the `c~rid` prefix) are checked here, before the engine sees
the request; one over a cap is answered at once with a 503 (`retry_after` 1) on its output subject. A slot is
freed when the request's final row is published (finish, abort, error) or when the engine rejects it.

Weights from disk (`update_weights_from_disk` on the control subject, `weight_update.py`'s `WeightUpdates`):
loaded in another thread, then swapped between steps once the engine's requests finished, paused or were
aborted; requests arriving meanwhile are held and run on the new weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from typing import Any

from ringserve.actors.common.heap_trim import HEAP_TRIM_IDLE_SECONDS, HeapTrimmer
from ringserve.actors.common.model_source import resolve_model
from ringserve.actors.common.runtime import HEARTBEAT_SECONDS, ActorContext
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.interface import EngineInterface
from ringserve.actors.scheduler import request_spans
from ringserve.actors.scheduler.admission import Admission
from ringserve.actors.scheduler.image_fetch import ImageFetcher
from ringserve.actors.scheduler.kv_share import KvSharing
from ringserve.actors.scheduler.engine_thread import on_engine_thread, on_passing_thread, serial_torch_on_this_thread
from ringserve.actors.scheduler.grammar_warm import early_grammars
from ringserve.actors.scheduler.kv_events import KvEventPublisher
from ringserve.actors.scheduler.step_messages import StepNumbering
from ringserve.actors.scheduler.row_publisher import RowPublisher
from ringserve.actors.scheduler.stream_interval import StreamCoalescer
from ringserve.actors.scheduler.weight_update import UPDATE_WEIGHTS, WeightLoader, WeightUpdates
from ringserve.bus.connection import Delivery
from ringserve.bus.errors import ApiError, server_error
from ringserve.bus.image_store import ImageStore
from ringserve.bus.messages import (
    AbortRequest, Accepted, ControlCommand, ControlReply, FinishReason, InfoQuery, RequestOutput,
    ReplicaLoad, SchedulerInfo, TokenizedRequest, TokenRow,
)
from ringserve.bus.ring_client import OPERATOR_ABORT
from ringserve.bus.subjects import SCHEDULER_QUEUE, InvalidRidError, validate_ring_rid
from ringserve.observability import tracing
from ringserve.observability.logging import log_event

log = logging.getLogger("scheduler")
ABORT_MEMORY_SECONDS = 60.0
CONTROL_ACTIONS = ("flush_cache", "abort_all", "pause", "continue", UPDATE_WEIGHTS, "load_lora_adapter",
                   "unload_lora_adapter")
REFUSAL_LOG_SECONDS = 1.0  # admission refusals are logged at most this often (a flood would flood the log)


class SchedulerActor:
    """Bridges the bus and the engine."""

    def __init__(self, ctx: ActorContext, engine: EngineInterface, admission: Admission | None = None,
                 load_weights: WeightLoader | None = None, stream_interval: int = 1,
                 kv_fetch_timeout: float | None = None, role: str = "both", prefill_timeout: float = 60.0) -> None:
        """`load_weights`: reads a checkpoint for `update_weights_from_disk` (None: the command is refused);
        `stream_interval`: tokens per published row of a request (`--stream-interval`, stream_interval.py);
        `kv_fetch_timeout`: with `--kv-share`, share KV blocks with the other replicas (kv_share.py); `role`:
        this replica's `--replica-role`, which its heartbeat tells the routers."""
        self._ctx = ctx
        self._streams = StreamCoalescer(stream_interval)
        self._numbering = StepNumbering(ctx.rank)  # numbered step messages: the detokenizers' evidence of loss
        self._updates = WeightUpdates(engine, load_weights)
        self._admission = admission if admission is not None else Admission()  # (an empty one is falsy)
        self._refusals_unlogged = 0
        self._refusal_logged_at = float("-inf")
        self._detokenizer_of: dict[str, int] = {}  # per request taken and not yet ended: where its rows go
        self._engine = engine
        self._inbox: list[tuple[str, Any]] = []
        self._wake = asyncio.Event()
        # aborts that arrived before their request (the two travel on different subjects)
        self._early_aborts: OrderedDict[str, float] = OrderedDict()
        self._checked_idle = True
        self._heap = HeapTrimmer()  # what the steps freed goes back to the system once idle a moment
        self._routed = 0  # requests handed to this replica since it started
        self._images = ImageFetcher(ImageStore(lambda: ctx.bus.client, ctx.subjects.namespace))
        self._image_tensors: dict[str, dict[str, Any]] = {}  # rid -> its images' tensors, fetched, until it is added
        self._spans = request_spans.create()  # no-ops unless tracing is on
        self._role = role
        self._share = KvSharing(ctx, engine, self._spans, kv_fetch_timeout, prefill_timeout,
                                self._enqueue) if kv_fetch_timeout else None
        self._rows = RowPublisher(ctx, engine, self._admission, self._spans, self._share, self._streams,
                                  self._numbering, self._detokenizer_of, lambda: self._info.step)
        # requests waiting for what they need from the bus: their image tensors, their prefix from another replica
        self._fetching: set[asyncio.Task[None]] = set()
        self._info = self._snapshot()

    async def start(self) -> dict[str, Any]:
        subjects, bus = self._ctx.subjects, self._ctx.bus
        self._ctx.live_rids = self._live_rids
        # routed to this replica by the tokenizers, or through the queue group when none was routed
        self._intake = [
            await bus.subscribe(subjects.tokenized_for(self._ctx.rank), TokenizedRequest, self._on_request),
            await bus.subscribe(subjects.tokenized, TokenizedRequest, self._on_request, queue=SCHEDULER_QUEUE)]
        self._ctx.on_drain.append(self._stop_intake)
        self._kv = KvEventPublisher(bus, subjects, self._ctx.rank)  # the routers' view of this prefix cache
        await self._kv.start()
        self._ctx.load = self._load
        await bus.subscribe(subjects.abort_any, AbortRequest, self._on_abort)
        await bus.subscribe(subjects.client_abort_any, AbortRequest, self._on_abort)  # a client's own rids only
        await bus.subscribe(subjects.scheduler_info, InfoQuery, self._on_info)
        await bus.subscribe(subjects.scheduler_command, ControlCommand, self._on_command)
        if self._share is not None:
            await self._share.start()
        self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._ctx.on_stop.append(self._close_spans)
        self._ctx.on_stop.append(self._keep_prefix_cache)
        return {"kv_total_tokens": self._info.kv_total_tokens, "context_length": self._info.context_length}

    async def _on_request(self, req: TokenizedRequest, delivery: Delivery) -> Accepted | None:
        try:
            validate_ring_rid(req.rid)  # a client's requests arrive with the scoped rid `client~rid`
        except InvalidRidError as exc:
            log_event(log, logging.WARNING, "dropped request with invalid rid", error=str(exc))
            return None
        self._spans.arrived(req.rid, delivery.traceparent)
        self._routed += 1
        if req.images or (self._share is not None and self._share.wants_fetch(req)):
            task = asyncio.get_running_loop().create_task(self._fetch_then_add(req))
            self._fetching.add(task)
            task.add_done_callback(self._fetching.discard)
        else:
            self._enqueue(req)
        return Accepted(rid=req.rid, replica=self._ctx.rank, detokenizer=req.detokenizer)

    def _enqueue(self, req: TokenizedRequest) -> None:
        """Queue a request for the engine (one arrived, or a prefill job of this replica's own, kv_share.py)."""
        self._inbox.append(("add", req))
        self._wake.set()

    async def _fetch_then_add(self, req: TokenizedRequest) -> None:
        """Fetch what `req` needs from the bus while other requests step, then queue it: its image tensors
        (image_fetch.py; a failed fetch ends the request with its error), or its prefix's KV from the replica
        holding it (kv_share.py; a failed fetch only means the prefix is computed)."""
        if req.images:
            try:
                self._image_tensors[req.rid] = await self._images.fetch(req.images)
            except ApiError as error:
                self._spans.queued(req)
                self._spans.rejected(req.rid, error.message)
                await self._ctx.bus.publish(self._ctx.subjects.output(req.rid), RequestOutput(rid=req.rid, error=error))
                return
        elif self._share is not None:
            try:
                await self._share.prefetch(req)
            except Exception:
                log.exception("fetching the KV of %s failed; computing it", req.rid)
        self._enqueue(req)

    def grammar_waited(self, rid: str, fields: dict[str, Any]) -> None:
        """Put a request's wait for its grammar on its trace (the engine's `GrammarManager.on_wait`)."""
        self._spans.grammar_waited(rid, fields)

    async def _close_spans(self) -> None:
        self._spans.close_all("the scheduler stopped")

    async def _keep_prefix_cache(self) -> None:
        """A graceful stop (drained or timed out, not failed): the cached prefixes go to the disk KV tier, after
        any step in flight, so the next start answers them from disk."""
        if self._ctx.draining.is_set() and self._ctx.exit_code == 0:
            await on_engine_thread(self._engine.keep_prefix_cache)

    async def _stop_intake(self) -> None:
        """Draining: take no new request (one already on its way is still taken and served)."""
        for sub in self._intake:
            await sub.unsubscribe()

    def _live_rids(self) -> int:
        """Requests held: in the engine or admitted (until its final row is published), queued, or held."""
        queued = sum(1 for kind, _ in self._inbox if kind == "add") + len(self._fetching)
        return max(self._engine.live_rids(), len(self._admission)) + queued + len(self._updates.held)

    async def _on_abort(self, msg: AbortRequest, delivery: Delivery) -> None:
        try:
            rid = self._ctx.subjects.rid_of(delivery.subject)
        except InvalidRidError:
            return
        self._inbox.append(("abort", (rid, msg.reason != OPERATOR_ABORT)))
        self._wake.set()

    async def _on_info(self, query: InfoQuery, delivery: Delivery) -> SchedulerInfo:
        # the snapshot is taken between steps; the decode graphs compile in the background, even while idle
        return dataclasses.replace(self._info, decode_graphs=self._engine.decode_graph_report(),
                                   **(self._share.counters() if self._share is not None else {}))  # served while idle

    async def _on_command(self, command: ControlCommand, delivery: Delivery) -> ControlReply:
        if command.action not in CONTROL_ACTIONS:
            return ControlReply(ok=False, message=f"unknown action {command.action!r}; one of {list(CONTROL_ACTIONS)}")
        if command.action == UPDATE_WEIGHTS:
            return await self._updates.load(command, self._submit_update)
        read = None  # an adapter to load is read and checked beside the steps, then served between two of them
        if command.action == "load_lora_adapter":
            read = await on_passing_thread(self._engine.read_lora, command.lora_name or "", command.lora_path or "",
                                           name="lora-read")
        done: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._inbox.append(("control", (command, done, read)))
        self._wake.set()
        return await done

    def _snapshot(self) -> SchedulerInfo:
        return dataclasses.replace(self._engine.stats(), rank=self._ctx.rank, weight_version=self._updates.version,
                                   requests_routed=self._routed, stream_interval=self._streams.interval,
                                   **(self._share.counters() if self._share is not None else {}))

    def _load(self) -> ReplicaLoad:
        """This replica's load for its heartbeat (the tokenizers route by it); `rank` is the replica id."""
        info = self._info
        return ReplicaLoad(replica=self._ctx.rank, interval=HEARTBEAT_SECONDS, num_running_reqs=info.num_running_reqs,
                           num_waiting_reqs=info.num_waiting_reqs + len(self._inbox),
                           kv_used_tokens=info.kv_used_tokens, kv_total_tokens=info.kv_total_tokens,
                           cache_hit_rate=info.cache_hit_rate, kv_epoch=self._kv.epoch, kv_seq=self._kv.seq,
                           tp_size=info.tp_size, role=self._role)

    def _submit_update(self, command: ControlCommand, checkpoint: Any, done: asyncio.Future[ControlReply]) -> None:
        self._inbox.append(("update", (command, checkpoint, done)))
        self._wake.set()

    async def _maybe_swap(self) -> None:
        """Swap a pending checkpoint in once the engine is ready; then hand it the requests held meanwhile."""
        swap = await self._updates.swap_when_ready(self._ctx.fail)
        if swap is None:
            return
        rows = [row for item in swap.held if (row := await self._take(item)) is not None]
        self._info = self._snapshot()
        swap.done.set_result(swap.reply)
        await self._rows.publish(rows)

    async def _run(self) -> None:
        try:
            while not self._ctx.stopping.is_set():
                await self._rows.publish(await self._apply_inbox())
                await self._maybe_swap()
                await self._kv.publish(*self._engine.kv_events())  # aborts, flushes and swaps evict too
                self._info = self._snapshot()
                if not self._engine.has_work():
                    await self._rows.send(self._streams.flush())  # no step follows soon to carry them
                    self._check_when_idle()
                    self._wake.clear()
                    if not self._inbox:
                        await self._until_woken()
                    continue
                self._checked_idle = False
                self._heap.note_work()
                started = tracing.now_ns()
                rows = await on_engine_thread(self._engine.step)
                self._info = self._snapshot()
                step_tp = self._spans.step(self._engine.last_plan(), self._info.step, started, tracing.now_ns())
                await self._rows.publish(rows, step_tp, after_step=True)
                await self._kv.publish(*self._engine.kv_events())  # one message per step at most
        except Exception as exc:
            log.exception("engine loop crashed")
            self._ctx.fail(f"engine loop crashed: {exc!r}")

    async def _until_woken(self) -> None:
        """Wait for a request or command; idle `HEAP_TRIM_IDLE_SECONDS` after steps, trim the heap meanwhile."""
        if self._heap.pending:
            try:
                await asyncio.wait_for(self._wake.wait(), HEAP_TRIM_IDLE_SECONDS)
                return
            except TimeoutError:
                self._heap.trim_in_background()
        await self._wake.wait()

    def _check_when_idle(self) -> None:
        if not self._checked_idle:
            self._engine.on_idle()
            self._checked_idle = True
            self._info = self._snapshot()

    async def _apply_inbox(self) -> list[TokenRow]:
        inbox, self._inbox = self._inbox, []
        rows: list[TokenRow] = []
        now = time.monotonic()
        while self._early_aborts and next(iter(self._early_aborts.values())) < now - ABORT_MEMORY_SECONDS:
            self._early_aborts.popitem(last=False)
        for kind, item in inbox:
            if kind == "abort":
                rid, may_precede = item
                row = self._engine.abort(rid) or self._abort_held(rid)
                if row is not None:
                    rows.append(row)
                elif may_precede:  # the entry's own abort overtook its request: end the request when it comes
                    self._early_aborts[rid] = now
            elif kind == "control":
                command, done, read = item
                reply = self._control(command, rows, read)
                if not done.done():
                    done.set_result(reply)
            elif kind == "update":
                rows.extend(self._updates.begin(*item, paused=self._info.paused))
            elif not self._updates.hold(item):  # held while the weights change: it runs on the new ones
                row = await self._take(item)
                if row is not None:
                    rows.append(row)
        return rows

    async def _take(self, item: TokenizedRequest) -> TokenRow | None:
        """Hand a new request to the engine (an error goes to its output); its abort row if its abort came first."""
        self._spans.queued(item)
        images = self._image_tensors.pop(item.rid, None)
        known = item.rid in self._detokenizer_of  # a duplicate of a live rid: its rows keep their detokenizer
        if item.rid in self._early_aborts:
            del self._early_aborts[item.rid]
            return self._abort_row(item)
        if not known:
            self._detokenizer_of[item.rid] = item.detokenizer
        error = self._add(item, images)
        if error is None and not item.stream:
            self._streams.whole_output(item.rid)
        if error is not None:
            if not known:
                del self._detokenizer_of[item.rid]
            self._spans.rejected(item.rid, error.message)
            await self._ctx.bus.publish(self._ctx.subjects.output(item.rid), RequestOutput(rid=item.rid, error=error))
        return None

    def _abort_row(self, item: TokenizedRequest) -> TokenRow:
        """The final row of a request that never reached the engine, sent to its detokenizer."""
        self._image_tensors.pop(item.rid, None)
        self._detokenizer_of.setdefault(item.rid, item.detokenizer)
        return TokenRow(rid=item.rid, token_ids=[], prompt_tokens=len(item.input_ids), completion_tokens=0,
                        finish=FinishReason(type="abort"))

    def _abort_held(self, rid: str) -> TokenRow | None:
        """End a request held during a weight update (its abort row), or None if `rid` is not held."""
        item = self._updates.abort_held(rid)
        if item is None:
            return None
        self._spans.queued(item)
        return self._abort_row(item)

    def _add(self, item: TokenizedRequest, images: dict[str, dict[str, Any]] | None = None) -> ApiError | None:
        """Admit `item` and hand it to the engine (with its images' tensors by hash); the error that refuses or
        rejects it (its slot then freed)."""
        duplicate = item.rid in self._admission  # a live rid again: the engine rejects it, and it takes no slot
        if not duplicate:
            refusal = self._admission.admit(item.rid)
            if refusal is not None:
                self._log_refusal(refusal)
                return refusal
        try:
            error = self._engine.add_request(item, images) if item.images else self._engine.add_request(item)
        except Exception as exc:  # one request's failure must not stop the loop
            log.exception("adding %s failed", item.rid)
            error = server_error(f"the scheduler could not add the request: {exc!r}"[:1000])
        if error is not None and not duplicate:
            self._admission.release(item.rid)
        return error

    def _log_refusal(self, refusal: ApiError) -> None:
        self._refusals_unlogged += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= REFUSAL_LOG_SECONDS:
            log_event(log, logging.WARNING, "refused requests over an admission cap",
                      refused=self._refusals_unlogged, live=len(self._admission), last=refusal.message)
            self._refusals_unlogged = 0
            self._refusal_logged_at = now

    def _control(self, command: ControlCommand, rows: list[TokenRow], read: Any = None) -> ControlReply:
        action = command.action
        if action in ("load_lora_adapter", "unload_lora_adapter"):
            name = command.lora_name or ""
            error = (self._engine.load_lora(name, command.lora_path or "", read) if action == "load_lora_adapter"
                     else self._engine.unload_lora(name))
            self._info = self._snapshot()  # /v1/models lists the adapters from it
            if error is not None:
                return ControlReply(ok=False, message=error.message, error=error)
            return ControlReply(ok=True, message=f"{action.split('_')[0]}ed LoRA adapter {name!r}")
        if action == "flush_cache":
            return ControlReply(ok=True, message="flushed the prefix cache",
                                detail={"freed_tokens": self._engine.flush_cache()})
        if action == "abort_all":
            held = self._updates.take_held()
            aborted = self._engine.abort_all() + [self._abort_row(item) for item in held]
            for item in held:
                self._spans.queued(item)
            rows.extend(aborted)
            return ControlReply(ok=True, message=f"aborted {len(aborted)} requests", detail={"aborted": len(aborted)})
        if action == "pause":
            self._engine.pause()
            return ControlReply(ok=True, message="paused")
        self._engine.resume()
        return ControlReply(ok=True, message="continued")


async def scheduler_main(ctx: ActorContext, model: str, config: EngineConfig,
                         admission: Admission | None = None, engine: EngineInterface | None = None) -> dict[str, Any]:
    """Entry point for the runtime: load the model, subscribe, start the loop. `engine`: one the caller built
    instead (rank 0 of a tensor-parallel replica, actors/scheduler/tp_follower.py)."""
    from ringserve.actors.engine.scheduling.engine_core import DTYPES, EngineCore
    from ringserve.actors.engine.models.weights import load_checkpoint

    def load_weights(path: str) -> Any:
        return load_checkpoint(path, DTYPES[config.resolved_dtype()])

    warm = config.grammar_warm_up  # --grammar-warm-up: warmed before ready, started before the weights load
    if engine is None:
        source = resolve_model(model)
        early = await on_engine_thread(early_grammars, source, config) if warm else None  # grammar_warm.py
        engine = await on_engine_thread(EngineCore.from_source, source, config,
                                         early.tokenizer if early is not None else None)
        engine.start_decode_graphs()
        if early is not None:
            early.hand_to(getattr(engine, "grammars", None))
    grammars = getattr(engine, "grammars", None)  # EngineCore's GrammarManager (grammar.py)
    warm = warm and grammars is not None
    if warm:
        grammars.warm_up()  # the early one's, when it took it over
    serial_torch_on_this_thread()
    actor = SchedulerActor(ctx, engine, admission, load_weights, config.stream_interval,
                           config.kv_fetch_timeout if config.kv_share else None, config.role_of(ctx.rank),
                           config.prefill_timeout)
    if grammars is not None:
        grammars.on_wait = actor.grammar_waited  # a request's wait for its grammar, on its trace
    detail = await actor.start()
    if warm:
        detail["grammars"] = await on_passing_thread(grammars.wait_warm, name="grammar-warm-wait")
    return detail
