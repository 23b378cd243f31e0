"""The engine's operator side: reports (`stats`, decode graphs, KV events), integrity checks, pause/resume,
the idle hook and weight swaps (`EngineCore` takes these methods; scheduling is engine.py's)."""

from __future__ import annotations

import logging
from typing import Any, Callable

from ringserve.actors.engine.config import KV_TIER_STOP_SAVE_SECONDS
from ringserve.actors.engine.scheduling.weight_swap import swap_engine_weights
from ringserve.bus.messages import SchedulerInfo
from ringserve.observability.logging import log_event

log = logging.getLogger("engine")


class EngineControl:
    """`EngineCore`'s control and report methods, called between steps; it sets what they read (`cache`, `runner`,
    `config`, `live`, the managers and the counters)."""

    cache: Any
    runner: Any
    config: Any
    live: dict[str, Any]
    decode: Any
    prefill: Any
    lora: Any
    speculation: Any
    paused: bool
    steps: int
    num_slots: int
    context_length: int
    model_name: str
    num_retractions: int
    overlap: bool
    _thread_choices: dict[str, int]
    _quantization: dict[str, Any]
    _kv_pool_report: dict[str, Any]
    _prompt_tokens: int
    _cached_tokens: int
    lora_names: Callable[[], list[str]]  # LoraServing's

    def start_decode_graphs(self) -> None:
        """On a CPU, start compiling decode graphs in the background (decode_graph.py); the server calls this
        when it serves. Nothing to do on a GPU (captured at start) or with graphs off."""
        if self.runner.graphs is not None:
            self.runner.graphs.start_compiling()

    def decode_graph_report(self) -> dict[str, str]:
        """What runs each decode batch size (`SchedulerInfo.decode_graphs`); safe from any thread, since
        background compiles change it between steps."""
        return self.runner.graphs.report() if self.runner.graphs is not None else {"mode": "off"}

    def flush_cache(self) -> int:
        """Drop every cached prefix no live request uses; returns the number of KV slots freed."""
        return self.cache.flush()

    def keep_prefix_cache(self) -> dict[str, Any]:
        """Stopping gracefully: save the cached prefix blocks to the KV tier's directory, most recently used first,
        within its bound and `KV_TIER_STOP_SAVE_SECONDS`, so a restart answers them from disk; {} without one."""
        return self.cache.save_to_tier(KV_TIER_STOP_SAVE_SECONDS)

    def kv_events(self) -> tuple[list[bytes], list[bytes]]:
        """Block hashes the prefix cache stored and evicted since the last call (`BasePrefixCache.take_block_events`)."""
        return self.cache.prefix_cache.take_block_events()

    def check_integrity(self) -> None:
        """Assert that the pool is partitioned exactly among free slots, the prefix cache and live requests."""
        self.cache.check_integrity(self.live.values())

    def stats(self) -> SchedulerInfo:
        """Current load, KV usage and settings (`rank` 0: the scheduler actor knows its own)."""
        free, cached = self.cache.num_free, self.cache.num_cached
        used = self.num_slots - free
        config = self.config
        return SchedulerInfo(
            rank=0, num_running_reqs=len(self.decode), num_waiting_reqs=len(self.prefill), kv_used_tokens=used,
            kv_total_tokens=self.num_slots, context_length=self.context_length, step=self.steps,
            model=self.model_name, kv_running_tokens=used - cached, kv_cached_tokens=cached,
            lora_adapters=self.lora_names(),
            cache_hit_rate=self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
            num_retractions=self.num_retractions, paused=self.paused, radix_cache=not config.disable_radix_cache,
            chunked_prefill_size=config.chunked_prefill_size if config.chunking else 0,
            overlap_schedule=self.overlap, torch_threads=dict(self._thread_choices),
            quantization=dict(self._quantization), kv_pool=dict(self._kv_pool_report),
            decode_graphs=self.decode_graph_report(),
            **(self.speculation.report() if self.speculation is not None else {}),
            **(self.cache.tier.report() if self.cache.tier is not None else {}))

    def pause(self) -> None:
        """Start no more steps (a step in flight is still applied); requests keep their KV, new ones queue."""
        self.paused = True

    def resume(self) -> None:
        """Step again after `pause`."""
        self.paused = False

    def live_rids(self) -> int:
        """Requests the engine holds state for."""
        return len(self.live)

    def on_idle(self) -> None:
        """Check the KV pool's integrity and take the thread counts the tuner has settled on (logged when
        they change)."""
        self.check_integrity()
        tuner = self.runner.thread_tuner
        choices = tuner.preferred() if tuner is not None else {}
        if choices != self._thread_choices:
            self._thread_choices = choices
            log_event(log, logging.INFO, "torch threads per step size, as measured",
                      choices=", ".join(f"{size}: {n}" for size, n in choices.items()))

    def update_weights(self, checkpoint: Any, model_name: str, check_only: bool = False) -> int:
        """Swap in the weights of `checkpoint` (a `Checkpoint` of the same architecture) in place; requests
        holding KV recompute it with them (actors/engine/scheduling/weight_swap.py). `model_name` is what
        `stats()` reports from then on. Raises `WeightMismatch` and changes nothing when it does not fit;
        `check_only` only checks. Call between steps, with none in flight. Returns the KV slots the prefix-cache
        flush freed."""
        if self.lora is not None:  # the wrapped linears hold the base under other names; not yet swapped
            raise ValueError("swapping weights while LoRA adapters are served is not supported yet; restart with the "
                             "new weights instead")
        return swap_engine_weights(self, checkpoint, model_name, check_only)
