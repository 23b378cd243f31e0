"""Prefill admission: which waiting requests enter this step, and how many of their tokens it computes.

Requests are taken in policy order (fcfs: arrival; lpm: longest cached prefix first) under a per-step token
budget, a cap on running requests and the KV slots available after this step's decodes. With chunking on, a
prompt longer than the chunk size (or the budget left) is prefilled in chunks over several steps. One request
is chunked at a time; each step it gets at most one chunk, planned first. While other requests wait (and one
more could run), it gets at most half of its chunk (`min(chunk size, budget)`) up front, and the rest of the
step's budget goes to waiting requests in policy order, so a short prompt arriving behind a long one is
prefilled whole in the next step instead of waiting for all of the long one's chunks; whatever of the budget
they leave (up to the chunk size) goes back to the chunked request. A waiting request that does not fit whole
beside the chunked one waits, and so do those behind it (the order is kept). Admission locks the request's
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
        chunked, cap = self.chunked, min(self._chunk_cap(), budget)
        if chunked is not None:
            # while others wait, half of the chunk is held back for them (topped up below if they leave it)
            n = min(chunked.uncached_len, cap - self._reserve(cap, num_running),
                    self.cache.available - num_running - 1)
            if n <= 0:
                return planned  # no slots for the chunked request: nothing behind it fits either
            self.cache.extend(chunked, n)
            planned.append((chunked, n))
            budget -= n
            if chunked.uncached_len == 0:
                self.chunked = None
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
                fits = False  # one request is chunked at a time: beside it, a prompt is prefilled whole
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
                self.chunked = req  # later requests may still join this step, if they fit whole
        if chunked is not None and self.chunked is chunked:
            # the budget the waiting requests left goes back to the chunked request, up to its chunk
            extra = min(chunked.uncached_len, cap - planned[0][1], budget,
                        self.cache.available - num_running - len(planned))
            if extra > 0:
                self.cache.extend(chunked, extra)
                planned[0] = (chunked, planned[0][1] + extra)
                if chunked.uncached_len == 0:
                    self.chunked = None
        return planned

    def _reserve(self, cap: int, num_running: int) -> int:
        """Tokens of the chunked request's `cap` held back this step for waiting requests: half, when one
        waits and could be admitted beside it (a free row, and the running cap leaves room), else none."""
        if not self.waiting or num_running + 2 > self.max_running or self.cache.table.num_free_rows == 0:
            return 0
        return cap // 2

    def _chunk_cap(self) -> int:
        return self.chunk_size if self.chunk_size > 0 else self.max_prefill_tokens

    def _ordered(self) -> list[Req]:
        if self.policy == "lpm" and 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            match = {id(r): self.cache.prefix_cache.match_prefix(r.ids[: r.prefix_limit])[0].cached_len
                     for r in self.waiting}
            return sorted(self.waiting, key=lambda r: -match[id(r)])
        return list(self.waiting)
