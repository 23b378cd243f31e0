"""Re-planning a FlashInfer wrapper safely while the step it was last planned for may still be queued.

A wrapper's `plan()` fills a pinned host buffer inside the wrapper and queues an asynchronous copy of it to
the device. Under the overlap loop the host plans step N+1 while step N is still queued, so planning the same
wrapper again could overwrite that host buffer before step N's copy has read it (the illegal-memory-access
Mini-SGLang fixed in overlap mode, vLLM's "stale-plan async-copy race"). `ReplanGuard` records an event after
each plan and waits on it before the next plan of the same wrapper. The wait is short in practice: by then the
engine has already waited for the tokens of the step before, which was queued ahead of that copy.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol


class Event(Protocol):
    """What the guard needs of `torch.cuda.Event`."""

    def record(self) -> Any: ...

    def synchronize(self) -> Any: ...


class ReplanGuard:
    """One event per planned object: `plan(key, fn)` waits for the previous plan of `key`, runs `fn`, records."""

    def __init__(self, new_event: Callable[[], Event]) -> None:
        """`new_event`: makes an event that `record()`s on the current stream (`torch.cuda.Event`)."""
        self._new_event = new_event
        self._events: dict[Hashable, Event] = {}

    def plan(self, key: Hashable, plan: Callable[[], None]) -> None:
        """Run `plan` once the copies queued by the last `plan` of `key` have run; then mark this one's."""
        previous = self._events.pop(key, None)
        if previous is not None:
            previous.synchronize()
        plan()
        event = self._new_event()
        event.record()
        self._events[key] = event
