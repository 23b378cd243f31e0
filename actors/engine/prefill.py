"""Prefill admission: which waiting requests enter this step, and how many of their tokens it computes.

Requests are taken in policy order (fcfs: arrival; lpm: longest cached prefix first) under a per-step token
budget, a cap on running requests and the KV slots available after this step's decodes. With chunking on, a
prompt longer than the chunk size (or the budget left) is prefilled in chunks over several steps; one request
is chunked at a time and its next chunk comes first in the following step. Admission locks the request's
cached prefix, writes its token ids to its row of the id table and allocates its slots here, before the
forward. Every token of an admitted request is known on the host (new, or retracted after its last step was
applied), so admission does not wait for a step in flight.
"""

from __future__ import annotations

import time
from collections import deque

from actors.engine.cache_manager import CacheManager
from actors.engine.request import Req

LPM_MAX_QUEUE = 128  # beyond this many waiting requests, sorting by prefix match costs more than it saves


class PrefillManager:
    """The waiting queue plus the request being prefilled in chunks."""

    def __init__(self, cache: CacheManager, max_prefill_tokens: int, chunk_size: int, policy: str,
                 max_running: int) -> None:
        self.cache = cache
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size  # <= 0: no chunking
        self.policy = policy
        self.max_running = max_running
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None

    def __len__(self) -> int:
        return len(self.waiting) + (self.chunked is not None)

    def add(self, req: Req, front: bool = False) -> None:
        """Queue `req`; retracted requests go to the front so they resume first."""
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def remove(self, req: Req) -> bool:
        """Take `req` out of the queue (or out of chunked prefill); False if it is not here."""
        if req is self.chunked:
            self.chunked = None
            return True
        try:
            self.waiting.remove(req)
        except ValueError:
            return False
        return True

    def schedule(self, num_running: int) -> list[tuple[Req, int]]:
        """Admit what fits: `(request, tokens to compute)` pairs, slots already allocated.

        `num_running` requests decode this step (their slots are allocated); each admitted request must also
        leave one slot per running request for the next decode step.
        """
        planned: list[tuple[Req, int]] = []
        budget = self.max_prefill_tokens
        if self.chunked is not None:
            req = self.chunked
            n = min(req.uncached_len, budget, self._chunk_cap(), self.cache.available - num_running - 1)
            if n > 0:
                self.cache.extend(req, n)
                planned.append((req, n))
                budget -= n
            if req.uncached_len == 0:
                self.chunked = None
            else:
                return planned  # the chunked request's next chunk blocks later arrivals (FCFS)
        for req in self._ordered():
            running_after = num_running + len(planned) + 1
            if running_after > self.max_running or budget <= 0 or self.cache.table.num_free_rows == 0:
                break
            self.cache.admit(req)
            need = req.uncached_len
            n = min(need, budget, self._chunk_cap()) if self.chunk_size > 0 else need
            fits = n + running_after <= self.cache.available
            if self.chunk_size <= 0 and planned and n > budget:
                fits = False  # without chunking, an over-budget prompt only runs as a step's sole prefill
            if n < need and self.chunked is not None:
                fits = False
            if not fits:
                self.cache.cache_req(req, finished=True)  # undo the admission: unlock, give the row back
                break
            self.waiting.remove(req)
            self.cache.table.write_ids(req.row, req.ids)  # what the forward reads its input ids from
            self.cache.extend(req, n)
            if not req.admitted:
                req.admitted, req.cached_tokens = True, req.prefix_len
                req.queue_time = time.monotonic() - req.arrived_at
            planned.append((req, n))
            budget -= n
            if n < need:
                self.chunked = req
                break
        return planned

    def _chunk_cap(self) -> int:
        return self.chunk_size if self.chunk_size > 0 else self.max_prefill_tokens

    def _ordered(self) -> list[Req]:
        if self.policy == "lpm" and 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            match = {id(r): self.cache.prefix_cache.match_prefix(r.ids[: r.seq_len - 1])[0].cached_len
                     for r in self.waiting}
            return sorted(self.waiting, key=lambda r: -match[id(r)])
        return list(self.waiting)
