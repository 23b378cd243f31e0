"""Batch policy decisions: FCFS admission under the prefill budget and KV headroom, newest-first preemption."""

from __future__ import annotations

from actors.engine.batch_policy import BatchPolicy
from actors.engine.request import Request
from tests.engine_helpers import greedy


def waiting(*lengths: int) -> list[Request]:
    return [Request(f"w{i}", [1] * n, greedy(8), None) for i, n in enumerate(lengths)]


def decoding(*cached: int) -> list[Request]:
    reqs = []
    for i, n in enumerate(cached):
        req = Request(f"r{i}", [1] * n, greedy(8), None, output_ids=[2])
        req.num_cached = n
        reqs.append(req)
    return reqs


def test_admission_respects_budget_headroom_order_and_request_cap() -> None:
    policy = BatchPolicy(max_prefill_tokens=10, max_running_requests=4)
    assert policy.admissions(waiting(4, 5, 2), num_running=0, free_slots=100) == 2  # 4 + 5 fit, +2 would not
    assert policy.admissions(waiting(30, 1), num_running=0, free_slots=100) == 1  # over budget, admitted alone
    assert policy.admissions(waiting(5, 1), num_running=0, free_slots=5) == 0  # no slot left to decode into
    assert policy.admissions(waiting(5, 1), num_running=0, free_slots=6) == 1
    # Two running requests take 2 slots this step and need 3 (with the newcomer) next step.
    assert policy.admissions(waiting(5), num_running=2, free_slots=9) == 0
    assert policy.admissions(waiting(5), num_running=2, free_slots=10) == 1
    assert policy.admissions(waiting(10, 1, 1), num_running=0, free_slots=10) == 0  # FCFS: the head blocks
    assert policy.admissions(waiting(1, 1, 1, 1, 1), num_running=2, free_slots=100) == 2  # cap of 4 running


def test_preemption_takes_the_newest_until_the_rest_can_decode() -> None:
    policy = BatchPolicy(max_prefill_tokens=10, max_running_requests=4)
    running = decoding(5, 6, 7)
    assert policy.preemptions(running, free_slots=3) == 0
    assert policy.preemptions(running, free_slots=2) == 1  # freeing 7 leaves 9 for 2 decodes
    assert policy.preemptions(decoding(5), free_slots=0) == 1
