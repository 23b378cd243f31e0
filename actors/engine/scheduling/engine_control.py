"""The engine's operator side: the decode graphs' report, prefix-cache flush and save, KV events, integrity
checks, pause/resume, the idle hook and weight swaps, all called between steps (`EngineCore.control`;
scheduling is engine_core.py's, the stats report engine_stats.py's)."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from ringserve.actors.engine.config import KV_TIER_STOP_SAVE_SECONDS
from ringserve.actors.engine.core.request import Req
from ringserve.actors.engine.runner.model_runner import ModelRunner
from ringserve.actors.engine.scheduling.cache_manager import CacheManager
from ringserve.actors.engine.scheduling.weight_swap import WeightSwap
from ringserve.observability.logging import log_event

log = logging.getLogger("engine")


class EngineControl:
    """Operator commands and self-checks over the KV cache and the runner; holds whether the engine is paused,
    the served model's name and the thread counts the tuner settled on."""

    def __init__(self, cache: CacheManager, runner: ModelRunner, live: Mapping[str, Req], weights: WeightSwap,
                 serves_lora: bool, model_name: str) -> None:
        """`live`: the engine's live requests by rid; `serves_lora`: adapters are served (weight swaps are refused
        then); `model_name`: what the stats report until a weight swap names another."""
        self.cache, self.runner, self.live, self.weights = cache, runner, live, weights
        self.serves_lora = serves_lora
        self.model_name = model_name
        self.paused = False
        self.thread_choices: dict[str, int] = {}

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

    def pause(self) -> None:
        """Start no more steps (a step in flight is still applied); requests keep their KV, new ones queue."""
        self.paused = True

    def resume(self) -> None:
        """Step again after `pause`."""
        self.paused = False

    def on_idle(self) -> None:
        """Check the KV pool's integrity and take the thread counts the tuner has settled on (logged when
        they change)."""
        self.check_integrity()
        tuner = self.runner.thread_tuner
        choices = tuner.preferred() if tuner is not None else {}
        if choices != self.thread_choices:
            self.thread_choices = choices
            log_event(log, logging.INFO, "torch threads per step size, as measured",
                      choices=", ".join(f"{size}: {n}" for size, n in choices.items()))

    def update_weights(self, checkpoint: Any, model_name: str, check_only: bool = False) -> int:
        """Swap in the weights of `checkpoint` (a `Checkpoint` of the same architecture) in place; requests
        holding KV recompute it with them (actors/engine/scheduling/weight_swap.py). `model_name` is what
        `stats()` reports from then on. Raises `WeightMismatch` and changes nothing when it does not fit;
        `check_only` only checks. Call between steps, with none in flight. Returns the KV slots the prefix-cache
        flush freed."""
        if self.serves_lora:  # the wrapped linears hold the base under other names; not yet swapped
            raise ValueError("swapping weights while LoRA adapters are served is not supported yet; restart with the "
                             "new weights instead")
        freed = self.weights.swap(checkpoint, check_only)
        if not check_only:
            self.model_name = model_name
        return freed
