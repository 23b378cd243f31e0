"""Prefill admission: which waiting requests enter this step, and how many of their tokens it computes.

Requests are taken in policy order (fcfs: arrival; lpm: longest cached prefix first) under a per-step token
budget B (`--max-prefill-tokens`), a cap on running requests and the KV slots available after this step's
decodes. With chunking on, a prompt longer than the chunk size C (`min(--chunked-prefill-size, B)`) or the
budget left is prefilled in chunks over several steps; up to `MAX_CHUNKED` prompts at once. The chunked
requests together get at most one chunk per step, planned first and split evenly between them. While other
requests wait (and one more could run) they get at most half of it (C - C//2) up front, and the rest of the
step's budget goes to waiting requests in policy order; whatever of the budget those leave (up to a chunk in
all) goes back to the chunked requests. A waiting prompt that does not fit whole in what is left becomes
chunked itself; with `MAX_CHUNKED` already chunked, or when a chunked prompt shares half a chunk or more of it
beyond what is cached (it waits for that prefix to be cached, not computing it twice), it is passed over for
this step, never holding up the prompts behind it (it used to wait, with everything behind it, until the chunked
prompt was done: a 4-token prompt behind a 1,000-token one waited 31 steps, the whole prefill of the 1,000-token
prompt beside them). A prompt becomes chunked only when all of it fits in the KV slots beside what the chunked
prompts still have to compute; otherwise it waits for memory, in order: chunked prompts could else fill the pool
between them, none able to finish and nothing left to free a slot (six 3k-token prompts in an 8k pool did).

The bound: every step starts with at least C//2 tokens of budget for the waiting queue, so at least its head
is admitted (whole or as a first chunk) or passed over, unless the KV slots, the free rows or the running cap
are exhausted (then the queue waits for memory, in order). A prompt with k prompts ahead of it in the queue
samples its first token within k + 1 steps (k + 2 in the overlap loop); with nothing ahead, in the next step.
A step's prefill is at most B tokens, of which the chunked prompts take at most C, so with B = C the wait is
at most k + 1 chunk-sized steps (tests/engine/test_engine_hol.py, tests/faults/test_busy_host_ttft.py). With a
`pace` (step_pace.py), C is cut to what a step of about a second prefills at the recent steps' cost while other
requests share the steps, so those steps stay short on a busy host too (issue 53); a prompt alone is cut only
past a few seconds a step (its time to first token).
Admission locks the request's
cached prefix, writes its token ids to its row of the id table and allocates its slots here, before the
forward. Every token of an admitted request is known on the host (new, or retracted after its last step was
applied), so admission does not wait for a step in flight.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from ringserve.actors.engine.scheduling.cache_manager import CacheManager
from ringserve.actors.engine.scheduling.images import chunk_tokens
from ringserve.actors.engine.core.request import Req
from ringserve.actors.engine.scheduling.step_pace import StepPace

LPM_MAX_QUEUE = 128  # beyond this many waiting requests, sorting by prefix match costs more than it saves
MAX_CHUNKED = 4  # prompts prefilled in chunks at once (each holds a row and its KV so far)


class PrefillManager:
    """The waiting queue plus the requests being prefilled in chunks."""

    def __init__(self, cache: CacheManager, max_prefill_tokens: int, chunk_size: int, policy: str,
                 max_running: int) -> None:
        self.cache = cache
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size  # <= 0: no chunking
        self.policy = policy
        self.max_running = max_running
        self.waiting: deque[Req] = deque()
        self.chunking: list[Req] = []  # oldest first
        # LoRA: distinct adapters among the running requests at most (0: no bound), and theirs
        self.adapter_limit = 0
        self.running_adapters: Callable[[], set[str | None]] = set
        # the model's images attend both ways (Gemma 3): a chunk never ends inside one (images.chunk_tokens)
        self.whole_images = False
        self.pace: StepPace | None = None  # cuts the chunk to keep steps short (None: the chunk is C always)

    @property
    def chunked(self) -> Req | None:
        """The oldest request being prefilled in chunks (None: none)."""
        return self.chunking[0] if self.chunking else None

    def __len__(self) -> int:
        return len(self.waiting) + len(self.chunking)

    def add(self, req: Req, front: bool = False) -> None:
        """Queue `req`; retracted requests go to the front so they resume first."""
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def remove(self, req: Req) -> bool:
        """Take `req` out of the queue (or out of chunked prefill); False if it is not here."""
        if any(r is req for r in self.chunking):
            self.chunking = [r for r in self.chunking if r is not req]
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
        cap = min(self._chunk_cap(num_running), budget)
        continuing = list(self.chunking)
        # while others wait, half of the chunk is held back for them (topped up below if they leave it)
        share = cap - self._reserve(cap, num_running)
        for req, n in zip(continuing, _split(share, continuing)):
            room = self.cache.available - num_running - len(planned) - 1
            n = self._fit(req, min(n, room), room)
            if n > 0:
                self.cache.extend(req, n)
                planned.append((req, n))
                budget -= n
        if continuing and not planned:
            return planned  # no slots for the chunked requests: nothing behind them fits either
        for req in self._ordered():
            held = {id(r) for r, _ in planned} | {id(r) for r in self.chunking}
            running_after = num_running + len(held) + 1
            if running_after > self.max_running or budget <= 0 or self.cache.table.num_free_rows == 0:
                break
            if self.adapter_limit and not self._adapter_fits(req, planned):
                continue  # another adapter's requests run: this one waits for a step with room for its own
            self.cache.admit(req)
            need = req.uncached_len
            n = min(need, budget, self._chunk_cap(num_running)) if self.chunk_size > 0 else need
            n = self._fit(req, n, need)
            fits = n + running_after <= self.cache.available
            if self.chunk_size <= 0 and planned and n > budget:
                fits = False  # without chunking, an over-budget prompt only runs as a step's sole prefill
            if not fits:
                self.cache.cache_req(req, finished=True)  # undo the admission: unlock, give the row back
                break
            if n < need and need + self._chunked_left() + running_after > self.cache.available:
                # chunked, it would share the pool with the chunked prompts until they all could hold it no more,
                # none able to go on and nothing running to free a slot: it waits for memory, in order
                self.cache.cache_req(req, finished=True)
                break
            if n < need and (len(self.chunking) >= MAX_CHUNKED or self._shares_a_chunk(req, cap)):
                self.cache.cache_req(req, finished=True)  # passed over: the prompts behind it may still fit
                continue
            self.waiting.remove(req)
            self.cache.table.write_ids(req.row, req.ids)  # what the forward reads its input ids from
            self.cache.extend(req, n)
            if not req.admitted:
                req.admitted, req.cached_tokens = True, req.prefix_len
                req.queue_time = time.monotonic() - req.arrived_at
            planned.append((req, n))
            budget -= n
            if n < need:
                self.chunking.append(req)
        self._top_up(planned, continuing, cap, budget, num_running)
        self.chunking = [r for r in self.chunking if r.uncached_len > 0]
        return planned

    def _top_up(self, planned: list[tuple[Req, int]], continuing: list[Req], cap: int, budget: int,
                num_running: int) -> None:
        """Give the budget the waiting requests left back to the `continuing` chunked requests, oldest first,
        up to `cap` tokens for all of them together this step."""
        index = {id(r): i for i, (r, _) in enumerate(planned)}
        left = min(cap - sum(n for r, n in planned if any(r is c for c in continuing)), budget)
        for req in continuing:
            extra = min(req.uncached_len, left, self.cache.available - num_running - len(planned) - 1)
            extra = self._fit(req, extra, extra)
            if extra <= 0:
                continue
            self.cache.extend(req, extra)
            left -= extra
            if id(req) in index:
                i = index[id(req)]
                planned[i] = (req, planned[i][1] + extra)
            else:
                index[id(req)] = len(planned)
                planned.append((req, extra))

    def _chunked_left(self) -> int:
        """Tokens the chunked prompts have still to compute (each a slot they will take)."""
        return sum(req.uncached_len for req in self.chunking)

    def _fit(self, req: Req, n: int, room: int) -> int:
        """`n` tokens of `req`'s next chunk moved off the inside of an image that must be computed whole
        (`images.chunk_tokens`: fewer, or through the image's end); 0 when that is more than `room`."""
        if n <= 0 or not self.whole_images or not req.images:
            return n
        n = chunk_tokens(req.images, req.cached_len, n)
        return n if n <= room else 0

    def _adapter_fits(self, req: Req, planned: list[tuple[Req, int]]) -> bool:
        """Whether `req`'s LoRA adapter (if any) runs already or leaves the running adapters within the bound."""
        name = req.params.lora_name
        if name is None:
            return True
        active = self.running_adapters() | {r.params.lora_name for r in self.chunking}
        active |= {r.params.lora_name for r, _ in planned}
        active.discard(None)
        return name in active or len(active) < self.adapter_limit

    def _shares_a_chunk(self, req: Req, cap: int) -> bool:
        """Whether a chunked request's prompt has half a chunk or more of `req`'s prompt beyond what is cached:
        then `req` waits for that prefix to be computed and cached, instead of computing it a second time (a
        shared chat template, far shorter than half a chunk, does not make it wait)."""
        k = req.prefix_len + max(1, cap // 2)
        key = req.key_ids(k)
        return len(req.ids) >= k and any(len(c.ids) >= k and c.key_ids(k) == key for c in self.chunking)

    def _reserve(self, cap: int, num_running: int) -> int:
        """Tokens of the chunked requests' `cap` held back this step for waiting requests: half, when one
        waits and could be admitted beside them (a free row, and the running cap leaves room), else none."""
        if (not self.waiting or num_running + len(self.chunking) + 1 > self.max_running
                or self.cache.table.num_free_rows == 0):
            return 0
        return cap // 2

    def _chunk_cap(self, num_running: int) -> int:
        if self.chunk_size <= 0:
            return self.max_prefill_tokens
        if self.pace is None:
            return self.chunk_size
        return self.pace.chunk(self.chunk_size, shared=num_running + len(self.waiting) + len(self.chunking) > 1)

    def _ordered(self) -> list[Req]:
        if self.policy == "lpm" and 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            cache = self.cache.prefix_cache
            match = {id(r): cache.match_prefix(r.key_ids(r.prefix_limit), r.cache_key)[0].cached_len
                     for r in self.waiting}
            return sorted(self.waiting, key=lambda r: -match[id(r)])
        return list(self.waiting)


def _split(total: int, reqs: list[Req]) -> list[int]:
    """`total` tokens split evenly over `reqs` (the oldest get the remainder), none beyond what one still has
    to prefill; what one cannot use goes to the others."""
    out = [0] * len(reqs)
    left = total
    while left > 0:
        open_ = [i for i, r in enumerate(reqs) if out[i] < r.uncached_len]
        if not open_:
            break
        each = max(1, left // len(open_))
        for i in open_:
            take = min(each, reqs[i].uncached_len - out[i], left)
            out[i] += take
            left -= take
    return out
