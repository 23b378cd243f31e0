"""The give-way hook (kernels/cpu/give_way.cpp): a busy Python thread that installed it stops taking the GIL
from a thread inside `stepping()`, and takes it as before outside."""

from __future__ import annotations

import threading
import time

import pytest

from kernels import cpu as cpu_kernels
from kernels.cpu.give_way import give_way_to_steps, stepping, times_given_way

pytestmark = pytest.mark.skipif(not cpu_kernels.compiled(), reason="the give-way hook is in the CPU kernels")

HANDOFFS = 40  # each `time.sleep(0)` hands the GIL to the busy thread and waits to take it back


def busy_progress_during(handoffs: int, step: bool, progress: list[int]) -> int:
    """How far the busy thread counts while this thread makes `handoffs` GIL handoffs, inside a step or not."""
    before = progress[0]
    with stepping(step):
        for _ in range(handoffs):
            time.sleep(0)
    return progress[0] - before


def busy(progress: list[int], stop: threading.Event, hooked: threading.Event) -> None:
    give_way_to_steps(True)
    hooked.set()

    def tick() -> None:  # a Python call: the hook sees calls and returns
        progress[0] += 1

    try:
        while not stop.is_set():
            tick()
    finally:
        give_way_to_steps(False)


def test_a_busy_thread_with_the_hook_gives_way_to_a_step_and_only_to_a_step() -> None:
    progress, stop, hooked = [0], threading.Event(), threading.Event()
    worker = threading.Thread(target=busy, args=(progress, stop, hooked), daemon=True)
    worker.start()
    assert hooked.wait(10)
    try:
        given = times_given_way()
        outside = busy_progress_during(HANDOFFS, False, progress)
        inside = busy_progress_during(HANDOFFS, True, progress)
        assert times_given_way() > given, "the busy thread gave way during the step"
        # Outside a step each handoff lets the busy thread run its switch interval; inside it sleeps instead.
        assert outside > 0
        assert inside < outside / 4, (inside, outside)
    finally:
        stop.set()
        worker.join(10)
    assert not worker.is_alive()
