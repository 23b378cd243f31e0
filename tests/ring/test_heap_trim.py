"""The freed C heap goes back to the system: `HeapTrimmer` (actors/common/heap_trim.py) in a process of its own.

The process fragments its heap the way a scheduler's steps do (blocks under the mmap threshold, every tenth
kept), frees the rest, and reads its resident memory before and after a trim; the scheduler's use of it is
covered by tests/api/test_soak.py, whose ring must end within its bound of where it started.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from ringserve.actors.common.heap_trim import HeapTrimmer, libc_malloc_trim

FRAGMENT_AND_TRIM = textwrap.dedent("""
    import json, threading, time
    from ringserve.actors.common.heap_trim import HeapTrimmer

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    blocks = [bytearray(64 * 1024) for _ in range(3200)]  # 200 MiB from the heap (under the mmap threshold)
    kept = blocks[::10]
    del blocks
    freed = rss()
    trimmer = HeapTrimmer()
    trimmer.trim_in_background()  # no work noted: nothing to do
    time.sleep(0.2)
    untouched = rss()
    trimmer.note_work()
    trimmer.trim_in_background()
    for thread in threading.enumerate():
        if thread.name == "heap-trim":
            thread.join()
    print(json.dumps({"freed": freed, "untouched": untouched, "trimmed": rss(), "pending": trimmer.pending}))
""")


@pytest.mark.skipif(libc_malloc_trim() is None, reason="this C library has no malloc_trim")
def test_a_trim_after_work_returns_the_freed_heap() -> None:
    done = subprocess.run([sys.executable, "-c", FRAGMENT_AND_TRIM], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rss = json.loads(done.stdout)
    mib = 1 << 20
    assert rss["untouched"] > rss["freed"] - 16 * mib, f"trimmed with no work noted: {rss}"
    assert rss["trimmed"] < rss["freed"] - 120 * mib, f"the freed heap stayed resident: {rss}"
    assert rss["pending"] is False


def test_trims_once_per_idle_spell_and_never_two_at_once() -> None:
    calls = []
    trimmer = HeapTrimmer(lambda: calls.append(1) or True)
    assert not trimmer.pending
    trimmer.trim_in_background()
    trimmer.note_work()
    assert trimmer.pending
    trimmer._running.acquire()  # a trim is under way: a second one does not start, and work stays noted
    trimmer.trim_in_background()
    assert trimmer.pending
    trimmer._running.release()
    trimmer.trim_in_background()
    assert not trimmer.pending
    trimmer._running.acquire()  # waits for the background trim to finish
    trimmer._running.release()
    assert calls == [1]
