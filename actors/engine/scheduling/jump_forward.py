"""Jump-forward for constrained requests: append at once the tokens a grammar forces next.

Where the grammar admits exactly one continuation (`GrammarManager.forced_tokens`), its tokens are appended to
the request on the host, stop-checked one by one, and the request re-enters the prefill queue so they are
computed in one extend step instead of one decode step each: the request's computed KV goes to the prefix
cache first, and admission takes it back from there. Needs the prefix cache (without one, the re-admission
would recompute the whole sequence).
"""

from __future__ import annotations

import torch

from ringserve.actors.engine.scheduling.cache_manager import CacheManager
from ringserve.actors.engine.scheduling.decode import DecodeManager
from ringserve.actors.engine.scheduling.grammar import GrammarManager
from ringserve.actors.engine.scheduling.prefill import PrefillManager
from ringserve.actors.engine.core.request import Req
from ringserve.actors.engine.scheduling.stop_checker import StopChecker
from ringserve.bus.messages import FinishReason
from ringserve.kernels.host_copy import to_device


class JumpForward:
    """Appends forced tokens and re-queues the request for one extend step."""

    def __init__(self, grammars: GrammarManager, stops: StopChecker, decode: DecodeManager, cache: CacheManager,
                 prefill: PrefillManager, context_length: int, device: torch.device) -> None:
        self._grammars = grammars
        self._stops = stops
        self._decode = decode
        self._cache = cache
        self._prefill = prefill
        self._context_length = context_length
        self._device = device
        self.tokens = 0  # tokens appended by jump-forward, without a decode step each

    def apply(self, req: Req, new: list[int]) -> FinishReason | None:
        """Append the tokens `req`'s grammar forces after its newest one (to `new` too, the step's row), checking
        stops after each; the finish reason if one of them ends the request."""
        room = min(req.params.max_new_tokens - req.output_len, self._context_length - req.seq_len)
        forced = self._grammars.forced_tokens(req, room)
        if not forced:
            return None
        finish = None
        appended = 0
        for token in forced:
            req.ids.append(token)
            new.append(token)
            appended += 1
            if req.penalties is not None:
                req.penalties.record(to_device([token], self._device))
            finish = self._stops.verdict(req)
            if finish is not None:
                break
        self.tokens += appended
        req.device_len = req.seq_len
        if finish is None:
            self._decode.remove(req)
            self._cache.cache_req(req, finished=True)
            self._prefill.add(req, front=True)
        return finish
