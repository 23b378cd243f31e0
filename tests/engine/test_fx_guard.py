"""A model forward and a torch.fx trace in another thread (what compiling a decode graph in the background does)
never overlap: the trace patches `torch.nn.Module.__call__` process-wide, and a forward caught inside it failed
with "module is not installed as a submodule" (actors/engine/runner/graphs/fx_guard.py)."""

from __future__ import annotations

import threading

import torch
from torch import nn

from ringserve.actors.engine.runner.graphs.fx_guard import install, no_fx_tracing


class Waiting(nn.Module):
    """A module whose forward, while traced, waits until told to go on."""

    def __init__(self, entered: threading.Event, release: threading.Event) -> None:
        super().__init__()
        self.entered, self.release = entered, release
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        self.release.wait(30)
        return self.inner(x)


def test_a_forward_waits_for_a_trace_in_another_thread() -> None:
    install()
    entered, release = threading.Event(), threading.Event()
    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(Waiting(entered, release),))
    tracer.start()
    assert entered.wait(30)  # the trace is in progress: Module.__call__ is patched now
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    outcome: list[object] = []

    def forward() -> None:
        try:
            with no_fx_tracing():
                outcome.append(model(torch.ones(1, 4)))
        except Exception as exc:  # what the guard prevents
            outcome.append(exc)

    worker = threading.Thread(target=forward)
    worker.start()
    worker.join(0.5)
    assert worker.is_alive() and not outcome  # waiting for the trace, not running inside it
    release.set()
    tracer.join(30)
    worker.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], torch.Tensor), outcome
