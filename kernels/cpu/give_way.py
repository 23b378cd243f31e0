"""A background compile thread gives way to the decode steps served beside it (`give_way.cpp` says why).

The compile thread calls `give_way_to_steps(True)` when it starts and `give_way_to_steps(False)` before it
ends; the serving thread runs each step inside `stepping()`. Without the C++ library both are no-ops (the
compile then competes for the GIL as any Python thread does).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ringserve.kernels.cpu import compiled

SLICE_US = 1000  # how long the compile thread may run Python during a step before it gives way again
WAIT_US = 8000  # how long it waits for the step to end each time it gives way


def give_way_to_steps(on: bool) -> None:
    """Install (True) or remove (False) the give-way hook on the calling thread."""
    if compiled():
        torch.ops.ringserve_qgemm.give_way_to_steps(on, SLICE_US, WAIT_US)


def times_given_way() -> int:
    """How often a compile thread has given way to a step in this process (0 without the library)."""
    return int(torch.ops.ringserve_qgemm.give_way_count()) if compiled() else 0


@contextmanager
def stepping(active: bool = True) -> Iterator[None]:
    """Mark a step as running on this thread while inside (nothing happens when `active` is False)."""
    if not active or not compiled():
        yield
        return
    torch.ops.ringserve_qgemm.set_stepping(True)
    try:
        yield
    finally:
        torch.ops.ringserve_qgemm.set_stepping(False)
