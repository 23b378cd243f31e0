"""The scheduler's side of `update_weights_from_disk`: the command's checks, the pending swap, and its answers.

The flow (`WeightUpdates`, driven by actors/scheduler/actor.py): the checkpoint is read in another thread
while the old weights serve; then the engine checks it against the running model (a 400 before anything
waits), new requests are held, the engine's requests finish ("wait"), pause ("pause") or are aborted
("abort"), and once no step is in flight the weights are swapped between steps, the prefix cache flushed,
and the held requests handed over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ringserve.actors.engine.interface import EngineInterface
from ringserve.actors.scheduler.engine_thread import on_engine_thread, on_passing_thread
from ringserve.bus.errors import ApiError, server_error
from ringserve.bus.messages import ControlCommand, ControlReply, TokenizedRequest, TokenRow
from ringserve.observability.logging import log_event

UPDATE_WEIGHTS = "update_weights_from_disk"
UPDATE_MODES = ("wait", "pause", "abort")
FIRST_WEIGHT_VERSION = "1"  # the weights loaded at start
COUNT_NAMES = {"wait": "num_waited_requests", "pause": "num_paused_requests", "abort": "num_aborted_requests"}
WeightLoader = Callable[[str], Any]  # a checkpoint path -> what the engine's `update_weights` takes
SwapSubmitter = Callable[[ControlCommand, Any, "asyncio.Future[ControlReply]"], None]
log = logging.getLogger("scheduler")


@dataclass
class PendingUpdate:
    """A loaded, checked checkpoint waiting for its swap, and the operator waiting for the answer."""

    command: ControlCommand
    checkpoint: Any
    done: asyncio.Future[ControlReply]
    was_paused: bool  # the engine was paused before (it then stays paused after a "pause" update)
    held_requests: int  # the engine's requests when the update began (waited for, paused or aborted)
    began: float = field(default_factory=time.monotonic)


def check_command(command: ControlCommand, can_load: bool, loading: bool) -> ApiError | None:
    """Why `command` cannot start (None: it can): no loader, no path, an unknown mode, another update running."""
    if not can_load:
        return server_error("this scheduler cannot load weights", 501)
    if not isinstance(command.model_path, str) or not command.model_path:
        return ApiError("give the model_path of the checkpoint to load", param="model_path")
    if command.mode not in UPDATE_MODES:
        return ApiError(f"mode must be one of {list(UPDATE_MODES)}, got {command.mode!r}", param="mode")
    if loading:
        return ApiError("another weight update is in progress; retry when it has finished", 409)
    return None


def refusal(error: ApiError) -> ControlReply:
    """The answer to an update that did not happen (the old weights keep serving)."""
    return ControlReply(ok=False, message=error.message, error=error)


def load_failure(path: str, exc: Exception) -> ControlReply:
    """The answer when reading the checkpoint failed: 400 for a missing or unsupported one, else 500."""
    if isinstance(exc, (OSError, ValueError)):
        return refusal(ApiError(f"cannot load {path!r}: {exc}"[:1000], param="model_path"))
    return refusal(server_error(f"loading {path!r} failed: {exc!r}"[:1000]))


def swapped(update: PendingUpdate, version: str, freed: int, held_new: int) -> ControlReply:
    """The answer once the new weights serve."""
    command = update.command
    return ControlReply(ok=True, message=f"weights of {command.model_path} serving as version {version}", detail={
        "weight_version": version, "model_path": command.model_path or "", COUNT_NAMES[command.mode]:
        update.held_requests, "freed_tokens": freed, "held_new_requests": held_new,
        "update_ms": int((time.monotonic() - update.began) * 1000)})


@dataclass
class Swapped:
    """A swap that happened: the requests held meanwhile (for the engine now), and the answer to give once
    they are handed over."""

    held: list[TokenizedRequest]
    reply: ControlReply
    done: asyncio.Future[ControlReply]


class WeightUpdates:
    """One scheduler's weight updates, one at a time: the load, the requests held meanwhile, the swap.

    `load` runs on the bus (it awaits the load and then the swap); `begin`, `swap_when_ready`, `hold` and
    `abort_held` are called from the scheduler's loop, between engine steps.
    """

    def __init__(self, engine: EngineInterface, load_weights: WeightLoader | None) -> None:
        """`load_weights`: reads a checkpoint (None: the command is refused)."""
        self._engine = engine
        self._load_weights = load_weights
        self._loading = False
        self.pending: PendingUpdate | None = None  # loaded and checked, waiting for its swap
        self.held: list[TokenizedRequest] = []  # requests that arrived during the update
        self.version = FIRST_WEIGHT_VERSION
        self._swaps = 0

    async def load(self, command: ControlCommand, submit: SwapSubmitter) -> ControlReply:
        """Check `command`, load its checkpoint on a passing thread, then `submit` it to the loop; the reply
        once the loop swapped it in (or refused it)."""
        error = check_command(command, self._load_weights is not None, self._loading)
        if error is not None:
            return refusal(error)
        self._loading = True
        try:
            started = time.monotonic()
            log_event(log, logging.INFO, "loading new weights", model_path=command.model_path, mode=command.mode)
            try:
                checkpoint = await on_passing_thread(self._load_weights, command.model_path, name="weight-loader")
            except Exception as exc:  # no such checkpoint, a model this engine cannot run, or a bug
                log_event(log, logging.WARNING, "loading new weights failed", model_path=command.model_path,
                          error=repr(exc)[:500])
                return load_failure(command.model_path or "", exc)
            log_event(log, logging.INFO, "loaded new weights", model_path=command.model_path,
                      seconds=round(time.monotonic() - started, 2))
            done: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
            submit(command, checkpoint, done)
            return await done
        finally:
            self._loading = False

    def begin(self, command: ControlCommand, checkpoint: Any, done: asyncio.Future[ControlReply],
              paused: bool) -> list[TokenRow]:
        """Check the checkpoint against the running model, then stop feeding the engine until the swap; the
        rows of the requests an "abort" update ended. `paused`: whether the engine is paused already."""
        try:
            self._engine.update_weights(checkpoint, command.model_path or "", check_only=True)
        except ValueError as exc:
            done.set_result(refusal(ApiError(str(exc)[:1000], param="model_path")))
            return []
        self.pending = PendingUpdate(command, checkpoint, done, paused, self._engine.live_rids())
        if command.mode == "pause":
            self._engine.pause()
        elif command.mode == "abort":
            return self._engine.abort_all()
        return []

    def hold(self, request: TokenizedRequest) -> bool:
        """Hold `request` while an update is pending (it runs on the new weights); False when none is."""
        if self.pending is None:
            return False
        self.held.append(request)
        return True

    def abort_held(self, rid: str) -> TokenizedRequest | None:
        """Take the held request `rid` out (it is being aborted); None if it is not held."""
        request = next((held for held in self.held if held.rid == rid), None)
        if request is not None:
            self.held.remove(request)
        return request

    def take_held(self) -> list[TokenizedRequest]:
        """Take every held request out (they are being aborted)."""
        held, self.held = self.held, []
        return held

    async def swap_when_ready(self, fail: Callable[[str], None]) -> Swapped | None:
        """Swap the pending checkpoint in once the engine is ready: no step in flight and, unless paused, no
        request left on the old weights. None when nothing was swapped; on a failed swap the reply says so and
        `fail` stops the scheduler (the weights may be half-copied)."""
        update = self.pending
        if update is None or self._engine.has_work():
            return None
        if update.command.mode != "pause" and self._engine.live_rids():
            return None
        self.pending = None
        command = update.command
        try:
            freed = await on_engine_thread(self._engine.update_weights, update.checkpoint, command.model_path or "")
        except Exception as exc:
            log.exception("swapping the weights failed")
            update.done.set_result(ControlReply(ok=False, message=f"swapping the weights failed: {exc!r}"[:1000]))
            fail(f"swapping the weights failed: {exc!r}")
            return None
        self._swaps += 1
        self.version = command.weight_version or str(int(FIRST_WEIGHT_VERSION) + self._swaps)
        if command.mode == "pause" and not update.was_paused:
            self._engine.resume()
        held, self.held = self.held, []
        reply = swapped(update, self.version, freed, len(held))
        log_event(log, logging.INFO, "swapped the weights", **reply.detail)
        return Swapped(held, reply, update.done)

