"""The disk cache of measured kernel timings, keyed by everything a plan depends on on this host.

A kernel plan depends on the CPU (model and ISA flags), on torch (its float32 GEMM and `torch._int_mm`), on
our kernels' source and on the thread count, so the cache key holds all of them; a change of any re-measures.
Timings live as JSON under `$RINGSERVE_CACHE/kernel_plans` (default `~/.cache/ringserve/kernel_plans`);
delete a file to re-measure. `RINGSERVE_KERNEL_PLAN_CACHE=0` neither reads nor writes the cache.

Timings measured while the host was busy (load average above `BUSY_LOAD` per core: a test run, a benchmark)
hold that moment's contention, under which a kernel on two threads loses to one on one; they are measured
again the first time they are wanted on a quiet host.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ringserve.kernels.cpu import cache_dir, isa
from ringserve.kernels.cpu.build_record import sources_digest
from ringserve.kernels.cpu.host import cpu_info, load_per_core
from ringserve.kernels.linear_plan.plan import Times

PLAN_VERSION = 1  # bump when the plan's meaning or format changes
BUSY_LOAD = 0.75  # load average (1 min) per core above which the host counts as busy


def host_key(extra: dict[str, Any]) -> dict[str, Any]:
    """Everything a measured plan depends on, plus `extra` (shapes, rows, candidates)."""
    cpu = cpu_info()
    return {"version": PLAN_VERSION, "cpu": cpu["model"], "flags": sorted(cpu["flags"].split()),
            "torch": torch.__version__, "kernels": sources_digest()[:16],  # every kernel source: the K-quants' too
            "isa": isa(), "threads": torch.get_num_threads(), **extra}


def source_digest(path: Path) -> str:
    """A short digest of a kernel's source file (a changed kernel is measured again)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "kernel_plans" / f"{digest}.json"


def _enabled() -> bool:
    return os.environ.get("RINGSERVE_KERNEL_PLAN_CACHE", "1") != "0"


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


def measured_times(key: dict[str, Any], measure: Callable[[], Times], use_cache: bool = True) -> tuple[Times, bool]:
    """The times stored under `key` (and True), or `measure()`'s, under `torch.no_grad`, stored there when
    `use_cache` (and False)."""
    stored = load(key) if use_cache else None
    if stored:
        return stored["times"], True
    with torch.no_grad():
        times = measure()
    if use_cache:
        store(key, {"times": times})
    return times, False
