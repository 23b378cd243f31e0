"""Model forwards never run while torch.fx traces in another thread.

`torch.fx.Tracer.trace` patches `torch.nn.Module.__call__` and `__getattr__` for the whole process while it
traces; compiling a decode graph in the background runs such traces (Inductor traces its pattern functions). A
forward on the engine thread in that moment is sent into the tracer's wrappers and fails ("module is not
installed as a submodule"): seen on a 2-core host, where a long eager prefill of one replica overlapped the
first graph compile. So `Tracer.trace` is wrapped once (`install`) to hold `FX_TRACE_LOCK`, and every forward of
the model holds it too (`no_fx_tracing`): a trace waits for the forward in flight, a forward for the trace (each
short: Inductor's pattern traces take milliseconds).
"""

from __future__ import annotations

import functools
import threading
from contextlib import AbstractContextManager
from typing import Any

FX_TRACE_LOCK = threading.RLock()
_installed = False


def install() -> None:
    """Wrap `torch.fx.Tracer.trace` to hold `FX_TRACE_LOCK` (once per process)."""
    global _installed
    if _installed:
        return
    from torch.fx import _symbolic_trace

    original = _symbolic_trace.Tracer.trace

    @functools.wraps(original)
    def trace(self: Any, *args: Any, **kwargs: Any) -> Any:
        with FX_TRACE_LOCK:
            return original(self, *args, **kwargs)

    _symbolic_trace.Tracer.trace = trace  # type: ignore[method-assign]
    _installed = True


def no_fx_tracing() -> AbstractContextManager[bool]:
    """Held around a model forward: no fx trace runs meanwhile (see the module docstring)."""
    install()
    return FX_TRACE_LOCK
