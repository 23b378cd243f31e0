"""The scheduler's side of `update_weights_from_disk`: the command's checks, the pending swap, and its answers.

The flow (actors/scheduler/actor.py): the checkpoint is read in another thread while the old weights serve;
then the engine checks it against the running model (a 400 before anything waits), new requests are held,
the engine's requests finish ("wait"), pause ("pause") or are aborted ("abort"), and once no step is in
flight the weights are swapped between steps, the prefix cache flushed, and the held requests handed over.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from bus.errors import ApiError, server_error
from bus.messages import ControlCommand, ControlReply

UPDATE_WEIGHTS = "update_weights_from_disk"
UPDATE_MODES = ("wait", "pause", "abort")
FIRST_WEIGHT_VERSION = "1"  # the weights loaded at start
COUNT_NAMES = {"wait": "num_waited_requests", "pause": "num_paused_requests", "abort": "num_aborted_requests"}
WeightLoader = Callable[[str], Any]  # a checkpoint path -> what the engine's `update_weights` takes


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
