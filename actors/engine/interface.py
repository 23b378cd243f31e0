"""The engine interface the scheduler actor drives, and nothing else of the engine.

`EngineCore` (one process, one device) implements it; a tensor-parallel rank group is meant to be a second
implementation behind the same methods. Every type crossing it is a torch-free protocol type from `ringserve.bus.params`,
`ringserve.bus.messages` and `ringserve.bus.errors`: requests in, token rows out, errors as `ApiError`.

Single-threaded by contract: the caller runs `step` and the other methods one at a time (between steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ringserve.bus.errors import ApiError
from ringserve.bus.messages import SchedulerInfo, TokenizedRequest, TokenRow


@dataclass
class StepPlan:
    """What one step ran, as plain data for the scheduler's tracing: the decode rids, then each prefill row's
    rid with the prompt positions `[start, start + length)` it computed (a chunk when it ends before the prompt)."""

    decode_rids: list[str]
    prefill: list[tuple[str, int, int]]  # (rid, start, length)
    num_tokens: int


class EngineInterface(Protocol):
    """Requests in, one batch per `step`, token rows out."""

    def add_request(self, request: TokenizedRequest,
                    images: dict[str, dict[str, Any]] | None = None) -> ApiError | None:
        """Queue a validated request, or say why it cannot run; `images[ref.hash]`: the processed tensors of each
        of its images (a vision-language model's)."""

    def abort(self, rid: str) -> TokenRow | None:
        """End a waiting or running request now and free its KV; its final row, or None if `rid` is not live."""

    def abort_all(self) -> list[TokenRow]:
        """Abort every live request; their final rows."""

    def has_work(self) -> bool:
        """Whether `step` would do anything (requests to run and not paused, or a step's tokens to apply)."""

    def step(self) -> list[TokenRow]:
        """Run one step; a row per request that produced a token or ended (a request's first row carries its
        `decode` parameters and `queue_time`)."""

    def decode_graph_report(self) -> dict[str, str]:
        """What runs each decode batch size; unlike the rest, callable from any thread at any time."""

    def stats(self) -> SchedulerInfo:
        """Load, KV usage and settings (`rank` 0: the caller knows its own)."""

    def flush_cache(self) -> int:
        """Drop every cached prefix no live request uses; the number of KV slots freed."""

    def keep_prefix_cache(self) -> dict[str, Any]:
        """Stopping gracefully: save the cached prefix blocks to the on-disk KV tier, so a restart answers them
        from disk; what was saved ({} without such a tier)."""

    def kv_events(self) -> tuple[list[bytes], list[bytes]]:
        """`(stored, removed)`: hashes (`ringserve.bus.kv_blocks`) of the whole blocks the prefix cache stored and evicted
        since the last call, netted; the scheduler publishes them as `KvEvents`."""

    def kv_share_namespace(self) -> str | None:
        """The KV tier's namespace (blocks cross replicas between equal ones), None without a tier."""

    def kv_cache_key(self, request: TokenizedRequest) -> str | None:
        """The prefix-cache tree the request's KV belongs to (cache_salt, LoRA adapter)."""

    def kv_held_blocks(self, ids: list[int], cache_key: str | None) -> int:
        """Leading whole blocks of `ids` held in the pool or the tier (engine thread)."""

    def kv_export(self, ids: list[int], cache_key: str | None, first: int, count: int, budget: int) -> list[bytes]:
        """Blocks `[first, first + count)` of `ids` for another replica, at most `budget` bytes (engine thread)."""

    def kv_import(self, ids: list[int], cache_key: str | None, first: int, payloads: list[bytes]) -> None:
        """Keep blocks fetched from another replica in the tier, for admission to load (engine thread)."""

    def pause(self) -> None:
        """Stop starting steps; running requests keep their KV, new ones queue (a step in flight is applied)."""

    def resume(self) -> None:
        """Start stepping again after `pause`."""

    def live_rids(self) -> int:
        """How many requests the engine holds state for."""

    def last_plan(self) -> StepPlan | None:
        """What the last step ran (for the step's trace span)."""

    def on_idle(self) -> None:
        """Called when the engine has fallen idle: a moment for self-checks and for settling measurements."""

    def read_lora(self, name: str, path: str) -> Any:
        """Read and check the PEFT adapter at `path` for `name` (or the ApiError saying why not) without serving
        it; safe on another thread while steps run."""

    def load_lora(self, name: str, path: str, adapter: Any = None) -> ApiError | None:
        """Serve the PEFT adapter at `path` as `name` (replacing one of that name), or say why not; `adapter`:
        what `read_lora` gave for them already (else it is read now)."""

    def unload_lora(self, name: str) -> ApiError | None:
        """Stop serving the adapter `name`, or say why not (unknown: 404; in use: 409)."""

    def update_weights(self, checkpoint: Any, model_name: str, check_only: bool = False) -> int:
        """Swap in a checkpoint of the same architecture (`ringserve.actors.engine.models.weights.Checkpoint`, loaded by the caller
        off the engine's thread) in place, recompute the KV of requests that hold some and flush the prefix cache;
        the KV slots freed. Raises ValueError (nothing changed) when it does not fit; `check_only` only checks.
        Only with no step in flight (`has_work()` false)."""
