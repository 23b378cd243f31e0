"""How much memory this process may still allocate: the host's MemAvailable, capped by its memory cgroup.

In a container (Docker `--memory`, a Kubernetes `limits.memory`, systemd `MemoryMax=`) the kernel kills the
process when its cgroup reaches the limit, however much RAM the host has free, so sizing from /proc/meminfo
alone over-allocates there. `available_memory()` returns min(host MemAvailable, cgroup headroom), where the
headroom is `limit - usage + inactive_file` (page cache the kernel reclaims before it kills anything, the way
the kubelet computes a working set), the smallest over the process's cgroup and its ancestors:

- cgroup v2: `memory.max` ("max" = no limit) and `memory.current`, plus `inactive_file` of `memory.stat`;
- cgroup v1: `memory/memory.limit_in_bytes` (a value near 2**63 = no limit) and `memory.usage_in_bytes`, plus
  `total_inactive_file` of `memory.stat`.

`MemoryBudget.total` is the steady figure (MemTotal or the cgroup limit) the KV pool is sized from, so its size
does not follow MemAvailable from one start to the next.

The cgroup root and the files read are parameters, so tests point them at a directory of fake files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"
PROC_MEMINFO = "/proc/meminfo"
V1_UNLIMITED = 1 << 60  # v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 on 4 KiB pages)


@dataclass(frozen=True)
class CgroupMemory:
    """One cgroup's memory limit and what it has charged."""

    version: int  # 1 or 2
    path: Path  # the cgroup's directory
    limit: int
    usage: int
    reclaimable: int  # inactive page cache

    @property
    def headroom(self) -> int:
        return max(0, self.limit - self.usage + min(self.reclaimable, self.usage))


@dataclass(frozen=True)
class MemoryBudget:
    """What `available_memory` found: `bytes` and where that figure came from."""

    bytes: int
    source: str  # "host MemAvailable", "total RAM", "cgroup v2 memory.max" or "cgroup v1 memory.limit_in_bytes"
    host_available: int
    cgroup: CgroupMemory | None = None  # the tightest limited cgroup, when there is one
    host_total: int = 0  # MemTotal (0: not read)

    @property
    def total(self) -> tuple[int, str]:
        """(bytes, source): the memory this process may ever use, which does not move between starts: the
        host's MemTotal, or the tightest cgroup limit when that is smaller (`bytes` when neither is known)."""
        if self.cgroup is not None and (not self.host_total or self.cgroup.limit < self.host_total):
            return self.cgroup.limit, f"cgroup v{self.cgroup.version} limit"
        if self.host_total:
            return self.host_total, "host MemTotal"
        return self.bytes, self.source

    def fields(self) -> dict[str, object]:
        """Structured log fields."""
        out: dict[str, object] = {"memory_source": self.source, "available_bytes": self.bytes,
                                  "host_available_bytes": self.host_available}
        if self.cgroup is not None:
            out.update(cgroup=str(self.cgroup.path), cgroup_limit_bytes=self.cgroup.limit,
                       cgroup_usage_bytes=self.cgroup.usage, cgroup_headroom_bytes=self.cgroup.headroom)
        return out


def host_available_memory(meminfo: str | os.PathLike[str] = PROC_MEMINFO) -> tuple[int, str]:
    """(bytes, source): Linux MemAvailable, else total RAM."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "total RAM"


def host_total_memory(meminfo: str | os.PathLike[str] = PROC_MEMINFO) -> int:
    """Bytes of RAM the host has: Linux MemTotal, else the physical page count."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:
        return None  # v2's "max"


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _own_cgroup_paths(proc_self_cgroup: str | os.PathLike[str]) -> dict[str, str]:
    """`/proc/self/cgroup` as {"v2": path, "memory": path} (only the entries that are there)."""
    found: dict[str, str] = {}
    try:
        lines = Path(proc_self_cgroup).read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            found["v2"] = path
        elif "memory" in controllers.split(","):
            found["memory"] = path
    return found


def _candidates(base: Path, own: str | None) -> list[Path]:
    """The process's cgroup directory under `base` and each ancestor up to `base` itself. When its path is
    not under `base` (a cgroup namespace shows "/", or the mount is the container's own), only `base`."""
    dirs: list[Path] = []
    if own:
        relative = Path(own.lstrip("/"))
        if (base / relative).is_dir():
            while relative != Path("."):
                dirs.append(base / relative)
                relative = relative.parent
    dirs.append(base)
    return dirs


def cgroup_memory_limits(root: str | os.PathLike[str] = CGROUP_ROOT,
                         proc_self_cgroup: str | os.PathLike[str] = PROC_SELF_CGROUP) -> list[CgroupMemory]:
    """Every limited memory cgroup above this process (v2 if mounted at `root`, else v1 under `root/memory`)."""
    root = Path(root)
    own = _own_cgroup_paths(proc_self_cgroup)
    found: list[CgroupMemory] = []
    if (root / "cgroup.controllers").exists() or (root / "memory.max").exists():  # v2 (unified) at root
        for directory in _candidates(root, own.get("v2")):
            limit = _read_int(directory / "memory.max")  # None: "max" or absent (the root cgroup has none)
            usage = _read_int(directory / "memory.current")
            if limit is not None and usage is not None:
                found.append(CgroupMemory(2, directory, limit, usage, _stat(directory / "memory.stat",
                                                                              "inactive_file")))
        return found
    v1 = root / "memory"
    for directory in _candidates(v1, own.get("memory")):
        limit = _read_int(directory / "memory.limit_in_bytes")
        usage = _read_int(directory / "memory.usage_in_bytes")
        if limit is not None and usage is not None and limit < V1_UNLIMITED:
            found.append(CgroupMemory(1, directory, limit, usage, _stat(directory / "memory.stat",
                                                                          "total_inactive_file")))
    return found


def available_memory(cgroup_root: str | os.PathLike[str] = CGROUP_ROOT,
                     proc_self_cgroup: str | os.PathLike[str] = PROC_SELF_CGROUP,
                     meminfo: str | os.PathLike[str] = PROC_MEMINFO) -> MemoryBudget:
    """Bytes this process can still allocate: min(host MemAvailable, the tightest cgroup's headroom)."""
    host, host_source = host_available_memory(meminfo)
    total = host_total_memory(meminfo)
    limits = cgroup_memory_limits(cgroup_root, proc_self_cgroup)
    if limits:
        tightest = min(limits, key=lambda c: c.headroom)
        if tightest.headroom < host:
            source = "cgroup v2 memory.max" if tightest.version == 2 else "cgroup v1 memory.limit_in_bytes"
            return MemoryBudget(tightest.headroom, source, host, tightest, total)
        return MemoryBudget(host, host_source, host, tightest, total)
    return MemoryBudget(host, host_source, host, host_total=total)
