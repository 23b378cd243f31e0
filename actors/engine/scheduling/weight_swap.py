"""Swapping the served model's weights for a checkpoint of the same architecture (`EngineCore.update_weights`).

The KV of the old weights is not reused: requests holding KV (running, or part-way through a chunked
prefill) go back to the front of the queue and recompute theirs with the new weights (their output so far is
kept), and the prefix cache is flushed.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Callable

from ringserve.actors.engine.core.request import PromptLogprobs
from ringserve.actors.engine.kv_tier.tier import namespace_of
from ringserve.actors.engine.models.weights import swap_weights
from ringserve.actors.engine.runner.kv_pool import KVPool
from ringserve.actors.engine.runner.model_runner import ModelRunner
from ringserve.actors.engine.scheduling.cache_manager import CacheManager
from ringserve.actors.engine.scheduling.decode import DecodeManager
from ringserve.actors.engine.scheduling.prefill import PrefillManager
from ringserve.observability.logging import log_event

log = logging.getLogger("engine")


class WeightSwap:
    """Swaps the runner's model's weights in place and sends the requests holding KV back to recompute it."""

    def __init__(self, runner: ModelRunner, pool: KVPool, cache: CacheManager, decode: DecodeManager,
                 prefill: PrefillManager, step_in_flight: Callable[[], bool]) -> None:
        """`step_in_flight`: whether a launched step's tokens are still to be applied (the overlap loop's)."""
        self.runner, self.pool, self.cache = runner, pool, cache
        self.decode, self.prefill = decode, prefill
        self.step_in_flight = step_in_flight

    def swap(self, checkpoint: Any, check_only: bool = False) -> int:
        """Check `checkpoint` against the model, then (unless `check_only`) swap it in; the KV slots the
        prefix-cache flush freed."""
        model, cache = self.runner.model, self.cache
        swap_weights(model, checkpoint, check_only=True)
        if check_only:
            return 0
        if self.step_in_flight():
            raise RuntimeError("update_weights needs the step in flight applied first: pause, then wait until "
                               "has_work() is false")
        holding = [*self.decode.running, *self.prefill.chunking]
        for req in reversed(holding):  # the oldest ends at the front of the queue
            if not self.decode.remove(req):
                self.prefill.remove(req)
            cache.drop_req(req)
            if req.prompt_logprobs is not None and not req.first_row_sent:  # scored again from the start
                req.prompt_logprobs = PromptLogprobs(req.prompt_logprobs.start)
            self.prefill.add(req, front=True)
        swap_weights(model, checkpoint)
        if self.runner.graphs is not None:  # compiled CPU graphs are built again, in the background
            self.runner.graphs.weights_changed()
        if cache.tier is not None:  # blocks of the old weights are never loaded for the new ones
            # a fresh token too: a quantized layer may hold its weights where the fingerprint does not look
            cache.tier.namespace = f"{namespace_of(self.pool, model)}:{secrets.token_hex(8)}"
        if holding:
            log_event(log, logging.INFO, "requests recompute their KV with the new weights", requests=len(holding))
        return cache.flush()
