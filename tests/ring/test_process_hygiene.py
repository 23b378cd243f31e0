"""Nothing the scheduler starts outlives it (actors/scheduler/process_group.py), all real: a `ringserve serve` of the
tiny model whose scheduler compiles a decode graph (a fresh Inductor cache, no stored graphs: Inductor runs g++),
stopped while a compiler runs, by Ctrl-C of the launcher and, separately, by SIGKILL of the scheduler (the
launcher then fail-stops). The compiler is the real g++ behind a wrapper (`$CXX`, which Inductor runs) that
leaves a long `sleep` behind, as a compiler's own subprocess would outlive a short compile: without the guard
those sleeps are orphans of pid 1 for minutes. Every process of the scheduler's tree, recorded from /proc while
it compiled, is gone within seconds, those reparented to pid 1 included. And the guardian alone ends the group
of a SIGKILLed leader, grandchildren included, and a ninja build's compilers (each in a group of its own); a
JIT build killed midway does not hold the next one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from ringserve.kernels import cpu as cpu_kernels
from tests.server_helpers import REPO, ServerHandle, process_alive, start_server, wait_for

COMPILERS = ("g++", "gcc", "c++", "cc", "cc1plus", "cc1", "as", "ld", "collect2", "ninja")
COMPILE_TIMEOUT = 300.0  # seconds until a compiler runs, on a busy 2-core host
GONE_TIMEOUT = 15.0
LINGER_SECONDS = 300  # how long the compiler wrapper's leftover `sleep` runs


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(ppid, start time, command name) of `pid`, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[19], name


def descendants(root: int) -> dict[tuple[int, str], str]:
    """(pid, start time) -> command name of every process below `root`."""
    children: dict[int, list[tuple[int, str, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(stat[0], []).append((int(entry), stat[1], stat[2]))
    found: dict[tuple[int, str], str] = {}
    todo = [root]
    while todo:
        for pid, start, name in children.get(todo.pop(), []):
            found[(pid, start)] = name
            todo.append(pid)
    return found


def survivors(recorded: dict[tuple[int, str], str]) -> dict[tuple[int, str], str]:
    """The recorded processes that still run (the same pid with the same start time, not a zombie)."""
    alive = {}
    for (pid, start), name in recorded.items():
        stat = _stat(pid)
        if stat is not None and stat[1] == start and process_alive(pid):
            alive[(pid, start)] = f"{name} (parent {stat[0]})"
    return alive


@pytest.fixture
def compiling_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> Iterator[ServerHandle]:
    """A server whose scheduler compiles its first decode graph from scratch."""
    if not cpu_kernels.compiled():
        pytest.skip("compiled decode graphs need the CPU kernels")
    monkeypatch.setenv("RINGSERVE_CPU_GRAPHS", "1")
    monkeypatch.setenv("RINGSERVE_GRAPH_STORE", "0")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    real = shutil.which("g++")
    if real is None:
        pytest.skip("no g++")
    wrapper = tmp_path / "bin" / "g++"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nsleep {LINGER_SECONDS} </dev/null >/dev/null 2>&1 &\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    server = start_server(str(tiny_model_dir))
    yield server
    server.stop()


def record_while_compiling(scheduler: int) -> dict[tuple[int, str], str]:
    """Every process below the scheduler, recorded until a compiler and a wrapper's leftover are among them."""
    recorded: dict[tuple[int, str], str] = {}
    deadline = time.monotonic() + COMPILE_TIMEOUT
    while not (any(name in COMPILERS for name in recorded.values()) and "sleep" in recorded.values()):
        assert time.monotonic() < deadline, f"no compiler ran below the scheduler: {recorded}"
        assert process_alive(scheduler), "the scheduler died"
        recorded.update(descendants(scheduler))
        time.sleep(0.02)
    recorded.update(descendants(scheduler))
    return recorded


@pytest.mark.parametrize("how", ["ctrl-c of the launcher", "sigkill of the scheduler"])
def test_no_process_of_the_schedulers_tree_outlives_it(compiling_server: ServerHandle, how: str) -> None:
    scheduler = compiling_server.actor_pids()["scheduler0"]
    recorded = record_while_compiling(scheduler)
    try:
        if how == "sigkill of the scheduler":
            os.kill(scheduler, signal.SIGKILL)
            compiling_server.proc.wait(timeout=30)  # the last scheduler died: the launcher fail-stops
            assert compiling_server.proc.returncode == 1, compiling_server.log()[-3000:]
        else:
            compiling_server.stop()
        assert wait_for(lambda: not survivors(recorded), GONE_TIMEOUT), (
            f"outlived the scheduler: {survivors(recorded)}; recorded: {sorted(recorded.values())}")
    finally:
        for pid, _ in survivors(recorded):  # a failed run leaves nothing behind either
            os.kill(pid, signal.SIGKILL)


def test_the_guardian_ends_the_group_of_a_killed_leader_grandchildren_included() -> None:
    code = ("import subprocess, sys, time\n"
            "from ringserve.actors.scheduler.process_group import guard_process_group\n"
            "assert guard_process_group() is not None\n"
            "subprocess.Popen(['sh', '-c', 'sleep 300 & sleep 300'])\n"
            "print('ok', flush=True)\n"
            "time.sleep(300)\n")
    leader = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE)
    try:
        assert leader.stdout is not None and leader.stdout.readline().strip() == b"ok"
        assert os.getpgid(leader.pid) == leader.pid, "the leader moved into a group of its own"
        recorded: dict[tuple[int, str], str] = {}

        def all_four_started() -> bool:  # the guardian, sh and its two sleeps
            recorded.update(descendants(leader.pid))
            return len(recorded) >= 4

        assert wait_for(all_four_started, 10), recorded
        leader.kill()
        leader.wait()
        assert wait_for(lambda: not survivors(recorded), 5), survivors(recorded)
    finally:
        if leader.poll() is None:
            leader.kill()


def test_a_ninja_builds_compilers_in_groups_of_their_own_end_too(tmp_path: Path) -> None:
    """The kernels' JIT build runs ninja, which puts each compiler in a process group of its own: the guardian's
    SIGTERM makes ninja end them before its SIGKILL."""
    ninja = Path(sys.executable).with_name("ninja")
    if not ninja.is_file():
        pytest.skip("no ninja beside this interpreter")
    (tmp_path / "build.ninja").write_text("rule slow\n  command = sleep 300; touch $out\n"
                                          "build a: slow\nbuild b: slow\n")
    code = ("import subprocess, sys, time\n"
            "from ringserve.actors.scheduler.process_group import guard_process_group\n"
            "assert guard_process_group() is not None\n"
            f"subprocess.Popen([{str(ninja)!r}, '-C', {str(tmp_path)!r}], stdout=subprocess.DEVNULL)\n"
            "print('ok', flush=True)\n"
            "time.sleep(300)\n")
    leader = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE)
    recorded: dict[tuple[int, str], str] = {}

    def both_compiles_run() -> bool:
        recorded.update(descendants(leader.pid))
        return list(recorded.values()).count("sleep") == 2

    try:
        assert leader.stdout is not None and leader.stdout.readline().strip() == b"ok"
        assert wait_for(both_compiles_run, 10), recorded
        leader.kill()
        leader.wait()
        assert wait_for(lambda: not survivors(recorded), 5), survivors(recorded)
    finally:
        if leader.poll() is None:
            leader.kill()
        for pid, _ in survivors(recorded):
            os.kill(pid, signal.SIGKILL)


def test_a_jit_build_killed_midway_does_not_hold_the_next_one(tmp_path: Path) -> None:
    """torch's JIT leaves its `lock` file when its build is killed; the next build clears it (our flock proves
    no one builds), while a build that really runs in another process is waited for."""
    from ringserve.kernels.cpu import _build_lock

    (tmp_path / "lock").write_text("")  # what a killed build leaves
    with _build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(tmp_path / 'ringserve-build.lock')!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True); time.sleep(1.5)\n")], stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
    started = time.monotonic()
    with _build_lock(tmp_path):
        waited = time.monotonic() - started
    holder.wait()
    assert waited > 0.5, "a build running in another process is waited for"


def test_each_checkout_jit_builds_in_a_folder_of_its_own(tmp_path: Path) -> None:
    """Two checkouts of the same sources used to share one JIT build folder, whose ninja file names the sources
    by path, and rebuilt the library in turn; the same checkout finds its own folder again."""
    from ringserve.kernels.cpu import SOURCES, jit_build_dir

    here = jit_build_dir(SOURCES[0].parent)
    assert jit_build_dir(SOURCES[0].parent) == here
    other = jit_build_dir(tmp_path / "another-clone" / "kernels" / "cpu")
    assert other != here and other.parent == here.parent
