"""Running inside a memory-limited container: the KV pool is sized from the cgroup's headroom, not the host's
free memory, and an actor killed by a signal (the OOM killer's SIGKILL) is named as such in the log.

The cgroup files are fakes in a temporary directory laid out like /sys/fs/cgroup (v2) or /sys/fs/cgroup/memory
(v1), with a fake /proc/self/cgroup and /proc/meminfo beside them."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ringserve.actors.common.memory_limits import available_memory, cgroup_memory_limits
from ringserve.actors.engine.config import CPU_MEM_FRACTION, POOL_ROUNDING, EngineConfig, available_host_memory
from ringserve.actors.launcher.supervisor import Supervisor, describe_exit, exit_cause
from ringserve.bus.subjects import Subjects

GIB = 1 << 30
HOST_AVAILABLE = 100 * GIB  # the host has plenty free; the container does not
LIMIT = int(2.5 * 10**9)  # the 2.5 GB memory cgroup of the report
USAGE = 600 * 10**6  # charged already (weights, interpreter)
INACTIVE_FILE = 100 * 10**6  # page cache the kernel would reclaim first


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_meminfo(tmp: Path, available: int = HOST_AVAILABLE) -> Path:
    path = tmp / "meminfo"
    _write(path, f"MemTotal:       {2 * available // 1024} kB\nMemFree: 1 kB\nMemAvailable:   {available // 1024} kB\n")
    return path


def fake_proc_self_cgroup(tmp: Path, text: str = "0::/\n") -> Path:
    path = tmp / "proc-self-cgroup"
    _write(path, text)
    return path


def fake_v2(root: Path, cgroup: str = "", limit: str = str(LIMIT), usage: int = USAGE,
            inactive_file: int = INACTIVE_FILE) -> None:
    """A unified hierarchy at `root` (with `cgroup.controllers`) and `cgroup`'s memory files under it."""
    _write(root / "cgroup.controllers", "cpuset cpu io memory pids\n")
    directory = root / cgroup.lstrip("/")
    _write(directory / "memory.max", f"{limit}\n")
    _write(directory / "memory.current", f"{usage}\n")
    _write(directory / "memory.stat", f"anon {usage - inactive_file}\nfile {inactive_file}\n"
                                      f"active_file 0\ninactive_file {inactive_file}\n")


def fake_v1(root: Path, cgroup: str = "", limit: int = LIMIT, usage: int = USAGE,
            inactive_file: int = INACTIVE_FILE) -> None:
    directory = root / "memory" / cgroup.lstrip("/")
    _write(directory / "memory.limit_in_bytes", f"{limit}\n")
    _write(directory / "memory.usage_in_bytes", f"{usage}\n")
    _write(directory / "memory.stat", f"cache {inactive_file}\ninactive_file {inactive_file}\n"
                                      f"total_inactive_file {inactive_file}\n")


def headroom(limit: int = LIMIT, usage: int = USAGE, inactive_file: int = INACTIVE_FILE) -> int:
    return limit - usage + inactive_file


def test_cgroup_v2_limit_caps_the_host_memory(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    fake_v2(root)
    budget = available_memory(root, fake_proc_self_cgroup(tmp_path), fake_meminfo(tmp_path))
    assert budget.bytes == headroom() and budget.source == "cgroup v2 memory.max"
    assert budget.host_available == HOST_AVAILABLE and budget.cgroup is not None and budget.cgroup.limit == LIMIT


def test_cgroup_v2_max_means_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    fake_v2(root, limit="max")
    budget = available_memory(root, fake_proc_self_cgroup(tmp_path), fake_meminfo(tmp_path))
    assert budget.bytes == HOST_AVAILABLE and budget.source == "host MemAvailable" and budget.cgroup is None


def test_cgroup_v2_limit_of_an_ancestor_counts(tmp_path: Path) -> None:
    """A Kubernetes pod: the container's cgroup says max, the pod's cgroup above it holds the limit."""
    root = tmp_path / "cgroup"
    fake_v2(root, "/kubepods/pod1", limit=str(LIMIT))
    fake_v2(root, "/kubepods/pod1/ctr", limit="max", usage=USAGE)
    proc = fake_proc_self_cgroup(tmp_path, "0::/kubepods/pod1/ctr\n")
    budget = available_memory(root, proc, fake_meminfo(tmp_path))
    assert budget.bytes == headroom() and budget.cgroup is not None
    assert budget.cgroup.path == root / "kubepods" / "pod1"


def test_host_memory_wins_when_it_is_the_smaller(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    fake_v2(root)
    budget = available_memory(root, fake_proc_self_cgroup(tmp_path), fake_meminfo(tmp_path, available=GIB))
    assert budget.bytes == GIB and budget.source == "host MemAvailable"


def test_cgroup_v1_limit_caps_the_host_memory(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    fake_v1(root, "/docker/abc")
    proc = fake_proc_self_cgroup(tmp_path, "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    budget = available_memory(root, proc, fake_meminfo(tmp_path))
    assert budget.bytes == headroom() and budget.source == "cgroup v1 memory.limit_in_bytes"


def test_cgroup_v1_huge_limit_means_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    fake_v1(root, limit=9223372036854771712)  # what v1 writes for "no limit" (4 KiB pages)
    assert cgroup_memory_limits(root, fake_proc_self_cgroup(tmp_path, "4:memory:/\n")) == []
    budget = available_memory(root, fake_proc_self_cgroup(tmp_path), fake_meminfo(tmp_path))
    assert budget.bytes == HOST_AVAILABLE and budget.source == "host MemAvailable"


def test_headroom_never_goes_negative(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    fake_v2(root, usage=LIMIT + 10**6, inactive_file=0)
    assert available_memory(root, fake_proc_self_cgroup(tmp_path), fake_meminfo(tmp_path)).bytes == 0


def test_no_cgroup_files_is_the_host_figure(tmp_path: Path) -> None:
    budget = available_memory(tmp_path / "absent", fake_proc_self_cgroup(tmp_path), fake_meminfo(tmp_path))
    assert budget.bytes == HOST_AVAILABLE and budget.cgroup is None


def test_available_host_memory_takes_a_cgroup_root(tmp_path: Path) -> None:
    fake_v2(tmp_path)
    assert available_host_memory(cgroup_root=str(tmp_path)) <= headroom()
    assert available_host_memory() > 0  # this machine's own cgroup and /proc/meminfo


def test_the_kv_pool_fits_a_2_5_gb_container_and_logs_what_it_was_sized_from(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "cgroup"
    fake_v2(root)
    budget = available_memory(root, fake_proc_self_cgroup(tmp_path), fake_meminfo(tmp_path))
    per_token = 46080  # SmolLM2-135M's KV in float32: 30 layers x 3 KV heads x 64 dims x (K, V) x 4 bytes
    config = EngineConfig(device="cpu", max_running_requests=10**6)  # no cap from full-context requests
    with caplog.at_level(logging.INFO, logger="engine"):
        tokens = config.kv_pool_tokens(per_token, context_length=8192, memory=budget)
    unrounded = int(headroom() * CPU_MEM_FRACTION // per_token)
    assert tokens == unrounded - unrounded % POOL_ROUNDING  # 4340 -> 4096 (a stable shape for compiled graphs)
    assert tokens * per_token <= LIMIT - USAGE  # the pool fits inside the container's limit
    host_sized = config.kv_pool_tokens(per_token, 8192, memory=available_memory(
        tmp_path / "absent", fake_proc_self_cgroup(tmp_path), fake_meminfo(tmp_path)))
    assert host_sized > tokens
    [record] = [r for r in caplog.records if r.getMessage() == "sized the KV pool"][:1]
    fields = record.fields  # type: ignore[attr-defined]
    assert fields["sized_from"] == "0.1 of cgroup v2 limit" and fields["tokens"] == tokens
    assert fields["memory_source"] == "cgroup v2 memory.max"
    assert fields["cgroup_limit_bytes"] == LIMIT and fields["host_available_bytes"] == HOST_AVAILABLE


def test_an_explicit_pool_size_is_logged_as_such(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine"):
        assert EngineConfig(max_total_tokens=1000).kv_pool_tokens(10**6, 100) == 1000
    [record] = [r for r in caplog.records if r.getMessage() == "sized the KV pool"]
    assert record.fields["sized_from"] == "--max-total-tokens"  # type: ignore[attr-defined]


@pytest.mark.parametrize("code, expected", [
    (0, "exited with code 0"),
    (1, "exited with code 1"),
    (-9, "killed by SIGKILL (signal 9): often the kernel's out-of-memory killer"),
    (-15, "killed by SIGTERM (signal 15)"),
    (-11, "killed by SIGSEGV (signal 11)"),
    (-200, "killed by signal 200 (signal 200)"),
])
def test_exit_cause_names_the_signal(code: int, expected: str) -> None:
    assert expected in exit_cause(code)
    if code != -9:
        assert "out-of-memory" not in exit_cause(code)


def test_sigkill_message_points_at_the_memory_limit() -> None:
    message = describe_exit("scheduler0", 1234, -9)
    assert message.startswith("actor scheduler0 (pid 1234) exited with code -9: it was killed by SIGKILL")
    assert "memory limit" in message and "--max-total-tokens" in message


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_real_process_killed_by_a_signal_is_named(sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc.send_signal(sig)
        proc.wait(timeout=30)
        supervisor = Supervisor([], "nats://127.0.0.1:1", Subjects("t"), watched={"scheduler0": proc})
        dead = supervisor._dead_actor()
        assert dead is not None and f"killed by {sig.name} (signal {int(sig)})" in dead, dead
        assert dead.startswith(f"actor scheduler0 (pid {proc.pid}) exited with code {-int(sig)}")
        assert ("out-of-memory" in dead) == (sig == signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
