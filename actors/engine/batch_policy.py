"""Which requests run in a step: preemption when decode outgrows the pool, then FCFS admission of prefills.

Pure decisions over counts; the engine applies them. Every running request decodes one token per step, so
a step needs one free slot per running request before anything new is admitted.
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.engine.request import Request


class BatchPolicy:
    """Continuous-batching policy with a per-step prefill token budget and a cap on running requests."""

    def __init__(self, max_prefill_tokens: int, max_running_requests: int) -> None:
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running_requests = max_running_requests

    def preemptions(self, running: Sequence[Request], free_slots: int) -> int:
        """How many of the most recently admitted running requests to preempt so the rest can decode.

        Preempting a request returns its cached slots and removes its own decode need.
        """
        need = len(running)
        count = 0
        for req in reversed(running):
            if free_slots >= need:
                break
            free_slots += req.num_cached
            need -= 1
            count += 1
        return count

    def admissions(self, waiting: Sequence[Request], num_running: int, free_slots: int) -> int:
        """How many requests from the head of `waiting` to prefill this step (FCFS: stop at the first misfit).

        Each admitted request must fit the prefill budget (except the first, which is admitted alone even if
        larger) and leave one free slot per running request for the next decode step.
        """
        available = free_slots - num_running  # this step's decode tokens
        budget = self.max_prefill_tokens
        count = 0
        for req in waiting:
            running_after = num_running + count + 1
            if running_after > self.max_running_requests:
                break
            tokens = req.num_new
            if count > 0 and tokens > budget:
                break
            if tokens + running_after > available:
                break
            available -= tokens
            budget -= tokens
            count += 1
        return count
