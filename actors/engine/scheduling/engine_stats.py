"""What the engine reports of itself (`EngineCore.stats`, the scheduler's `SchedulerInfo`): load, KV usage,
counters and settings, read from the parts that hold them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.lora.serving import LoraServing
from ringserve.actors.engine.scheduling.cache_manager import CacheManager
from ringserve.actors.engine.scheduling.decode import DecodeManager
from ringserve.actors.engine.scheduling.engine_control import EngineControl
from ringserve.actors.engine.scheduling.prefill import PrefillManager
from ringserve.actors.engine.speculative.verify_step import SpeculativeSteps
from ringserve.bus.messages import SchedulerInfo


@dataclass
class StepCounters:
    """What the engine counts as it steps."""

    steps: int = 0
    num_retractions: int = 0
    # Overlap loop, per step that launched a batch: launched while the step before was still unapplied, or
    # after applying it first because the pool was short (retraction). Neither counts a launch with nothing
    # in flight before it (the first after idling, and every step of the plain loop).
    overlapped_steps: int = 0
    drained_steps: int = 0
    prompt_tokens: int = 0  # of the prompts that reached the prefix cache (the hit rate's denominator)
    cached_tokens: int = 0  # of those, the tokens the prefix cache held


@dataclass
class StartupReport:
    """What the engine's construction settled: the pool's size, the quantized layers' kernels, the loop, the
    execution plan."""

    num_slots: int
    context_length: int
    overlap: bool
    kv_pool: dict[str, Any]
    quantization: dict[str, Any]
    execution: dict[str, str] = field(default_factory=dict)


class EngineStats:
    """Builds `SchedulerInfo` from the cache, the queues, the counters and the operator side."""

    def __init__(self, config: EngineConfig, startup: StartupReport, counters: StepCounters, cache: CacheManager,
                 decode: DecodeManager, prefill: PrefillManager, control: EngineControl, adapters: LoraServing,
                 speculation: SpeculativeSteps | None) -> None:
        self.config, self.startup, self.counters = config, startup, counters
        self.cache, self.decode, self.prefill = cache, decode, prefill
        self.control, self.adapters, self.speculation = control, adapters, speculation

    def info(self) -> SchedulerInfo:
        """Current load, KV usage and settings (`rank` 0: the scheduler actor knows its own)."""
        free, cached = self.cache.num_free, self.cache.num_cached
        startup, counters, config, control = self.startup, self.counters, self.config, self.control
        used = startup.num_slots - free
        return SchedulerInfo(
            rank=0, num_running_reqs=len(self.decode), num_waiting_reqs=len(self.prefill), kv_used_tokens=used,
            kv_total_tokens=startup.num_slots, context_length=startup.context_length, step=counters.steps,
            model=control.model_name, kv_running_tokens=used - cached, kv_cached_tokens=cached,
            lora_adapters=self.adapters.names(),
            cache_hit_rate=counters.cached_tokens / counters.prompt_tokens if counters.prompt_tokens else 0.0,
            num_retractions=counters.num_retractions, paused=control.paused,
            radix_cache=not config.disable_radix_cache,
            chunked_prefill_size=config.chunked_prefill_size if config.chunking else 0,
            overlap_schedule=startup.overlap, torch_threads=dict(control.thread_choices),
            quantization=dict(startup.quantization), kv_pool=dict(startup.kv_pool),
            decode_graphs=control.decode_graph_report(), execution=dict(startup.execution),
            **(self.speculation.report() if self.speculation is not None else {}),
            **(self.cache.tier.report() if self.cache.tier is not None else {}))
