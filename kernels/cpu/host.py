"""This host as timing sees it: the CPU's model and ISA flags, its load, and functions timed side by side.

Kernel plans (`ringserve.kernels.linear_plan`), the compiled-graph store and the benchmarks key and time by
these.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Callable


def cpu_info() -> dict[str, str]:
    """The host CPU's model name and ISA flags (from /proc/cpuinfo; platform's names where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "flags", "Features"):
                fields.setdefault(key.strip(), value.strip())
            if "model name" in fields and ("flags" in fields or "Features" in fields):
                break
    except OSError:
        pass
    return {"model": fields.get("model name") or platform.processor() or platform.machine(),
            "flags": fields.get("flags") or fields.get("Features", "")}


def load_per_core() -> float:
    """The host's load average over the last minute per CPU core (0 where the OS does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return 0.0


def time_interleaved(fns: dict[str, Callable[[], object]], rounds: int = 5,
                     target_s: float = 0.003) -> dict[str, float]:
    """Seconds per call of each function, the minimum over `rounds` rounds that run every function in turn
    (so a burst of load from other processes hits all of them alike; the minimum discards the bursts).
    Each round calls a function often enough to take about `target_s`."""
    reps: dict[str, int] = {}
    for name, fn in fns.items():  # warm-up (first-call allocations, caches), and a first estimate
        fn()
        start = time.perf_counter()
        fn()
        reps[name] = max(1, min(1000, int(target_s / max(time.perf_counter() - start, 1e-7))))
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / reps[name])
    return best
