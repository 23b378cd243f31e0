"""Timing candidate kernels side by side, and a disk cache of what was measured, keyed by the host.

A kernel plan (which kernel each linear shape runs at each row count, `ringserve.kernels.quantization`) depends on the
CPU (model and ISA flags), on torch (its float32 GEMM and `torch._int_mm`), on our kernels' source and on the
thread count, so the cache key holds all of them; a change of any re-measures. Plans live as JSON under
`$RINGSERVE_CACHE/kernel_plans` (default `~/.cache/ringserve/kernel_plans`); delete a file to re-measure.
`RINGSERVE_KERNEL_PLAN_CACHE=0` neither reads nor writes the cache.

A plan measured while the host was busy (load average above `BUSY_LOAD` per core: a test run, a benchmark)
holds that moment's contention, under which a kernel on two threads loses to one on one; it is measured again
the first time it is wanted on a quiet host.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ringserve.kernels.cpu import _SOURCE, cache_dir, isa

PLAN_VERSION = 1  # bump when the plan's meaning or format changes
BUSY_LOAD = 0.75  # load average (1 min) per core above which the host counts as busy


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


def host_key(extra: dict[str, Any]) -> dict[str, Any]:
    """Everything a measured plan depends on, plus `extra` (shapes, rows, candidates)."""
    cpu = cpu_info()
    return {"version": PLAN_VERSION, "cpu": cpu["model"], "flags": sorted(cpu["flags"].split()),
            "torch": torch.__version__, "kernels": hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16],
            "isa": isa(), "threads": torch.get_num_threads(), **extra}


def _path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "kernel_plans" / f"{digest}.json"


def _enabled() -> bool:
    return os.environ.get("RINGSERVE_KERNEL_PLAN_CACHE", "1") != "0"


def load_per_core() -> float:
    """The host's load average over the last minute per CPU core (0 where the OS does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return 0.0


def load(key: dict[str, Any]) -> dict[str, Any] | None:
    """The measurements stored under `key`, or None (none stored, unreadable, the cache off, or measured on a
    busy host and the host is quiet now)."""
    if not _enabled():
        return None
    try:
        stored = json.loads(_path(key).read_text())
    except (OSError, ValueError):
        return None
    if stored.get("key") != key:
        return None
    if stored.get("load_per_core", 0.0) > BUSY_LOAD >= load_per_core():
        return None
    return stored.get("result")


def store(key: dict[str, Any], result: dict[str, Any]) -> Path | None:
    """Write `result` under `key` (atomically: concurrent starts may race); the file, or None if off/failed."""
    if not _enabled():
        return None
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "result": result, "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
                                   "load_per_core": round(load_per_core(), 2)}, indent=1))
        tmp.replace(path)
    except OSError:
        return None
    return path


def measured_times(key: dict[str, Any], measure: Callable[[], dict[str, dict[str, float]]],
                   use_cache: bool = True) -> tuple[dict[str, dict[str, float]], bool]:
    """The times stored under `key` (and True), or `measure()`'s, under `torch.no_grad`, stored there when
    `use_cache` (and False). Times are keyed "out,in,rows" -> {kernel: seconds per call}."""
    stored = load(key) if use_cache else None
    if stored:
        return stored["times"], True
    with torch.no_grad():
        times = measure()
    if use_cache:
        store(key, {"times": times})
    return times, False


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
