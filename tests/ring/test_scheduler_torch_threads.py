"""The scheduler process keeps one OpenMP team: the event loop's thread runs its torch ops serially
(actors/scheduler/engine_thread.py), and idle OpenMP workers spin briefly before they sleep
(actors/scheduler/__main__.py). Checked in fresh interpreters, since OpenMP's state is per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# An "engine" thread runs parallel ops on two threads, then the main thread copies a tensor large enough to go
# parallel; prints how many threads the copy added to the process.
SCRIPT = """
import os, sys, threading
import torch
from ringserve.actors.scheduler.engine_thread import serial_torch_on_this_thread
torch.set_num_threads(2)
ready, done = threading.Event(), threading.Event()
def engine():  # its parallel ops start its OpenMP team; it lives on, as the engine thread does
    x = torch.randn(1 << 20)
    for _ in range(3):
        x.add_(1)
    ready.set()
    done.wait()
thread = threading.Thread(target=engine)
thread.start()
ready.wait()
if sys.argv[1] == "serial":
    serial_torch_on_this_thread()
before = len(os.listdir("/proc/self/task"))
torch.cat([torch.zeros(1 << 20), torch.ones(1 << 20)])  # as the KV pool's free-slot list is
print(len(os.listdir("/proc/self/task")) - before)
done.set()
thread.join()
"""


def threads_added(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    return int(out.stdout.split()[-1])


def test_the_loop_threads_torch_ops_start_no_openmp_team_of_their_own() -> None:
    assert threads_added("default") >= 1, "a parallel copy on a second thread starts OpenMP workers"
    assert threads_added("serial") == 0


def spin_count_set(extra_env: dict[str, str]) -> str:
    """GOMP_SPINCOUNT after importing the scheduler's entry point, in an environment without OpenMP settings
    but `extra_env`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    probe = "import os, ringserve.actors.scheduler.__main__; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True, env={**env, **extra_env})
    return out.stdout.split()[-1]


def test_the_scheduler_bounds_how_long_idle_openmp_workers_spin() -> None:
    assert spin_count_set({}) == "3000"
    assert spin_count_set({"OMP_WAIT_POLICY": "PASSIVE"}) == "None"  # a user's own policy is left alone
