"""Swapping an engine's weights for a checkpoint of the same architecture (`EngineCore.update_weights`).

The KV of the old weights is not reused: requests holding KV (running, or part-way through a chunked
prefill) go back to the front of the queue and recompute theirs with the new weights (their output so far is
kept), and the prefix cache is flushed.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

from ringserve.actors.engine.core.request import PromptLogprobs
from ringserve.actors.engine.kv_tier.tier import namespace_of
from ringserve.actors.engine.models.weights import swap_weights
from ringserve.observability.logging import log_event

if TYPE_CHECKING:  # the engine imports this module
    from ringserve.actors.engine.scheduling.engine_core import EngineCore

log = logging.getLogger("engine")


def swap_engine_weights(engine: EngineCore, checkpoint: Any, model_name: str, check_only: bool = False) -> int:
    """`EngineCore.update_weights`: check `checkpoint` against the engine's model, then (unless `check_only`) swap
    it in; the KV slots the prefix-cache flush freed."""
    swap_weights(engine.runner.model, checkpoint, check_only=True)
    if check_only:
        return 0
    if engine._inflight is not None:
        raise RuntimeError("update_weights needs the step in flight applied first: pause, then wait until "
                           "has_work() is false")
    holding = [*engine.decode.running, *engine.prefill.chunking]
    for req in reversed(holding):  # the oldest ends at the front of the queue
        if not engine.decode.remove(req):
            engine.prefill.remove(req)
        engine.cache.drop_req(req)
        if req.prompt_logprobs is not None and not req.first_row_sent:  # scored again from the start
            req.prompt_logprobs = PromptLogprobs(req.prompt_logprobs.start)
        engine.prefill.add(req, front=True)
    swap_weights(engine.runner.model, checkpoint)
    if engine.runner.graphs is not None:  # compiled CPU graphs are built again, in the background
        engine.runner.graphs.weights_changed()
    engine.model_name = model_name
    if engine.cache.tier is not None:  # blocks of the old weights are never loaded for the new ones
        # a fresh token too: a quantized layer may hold its weights where the fingerprint does not look
        engine.cache.tier.namespace = f"{namespace_of(engine.pool, engine.runner.model)}:{secrets.token_hex(8)}"
    if holding:
        log_event(log, logging.INFO, "requests recompute their KV with the new weights", requests=len(holding))
    return engine.cache.flush()
