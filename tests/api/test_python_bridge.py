"""The Python API's loop thread (ringserve/_bridge.py): a Ctrl-C that the kernel hands to the loop thread
still interrupts the main thread waiting in a blocking call (in CI the interrupted-caller test's process
once ran on after its SIGINT), and a timeout or the awaitable's own TimeoutError still end the call."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from ringserve._bridge import LoopThread


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread("test-loop")
    yield thread
    thread.stop()


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX threads' signals")
def test_a_ctrl_c_delivered_to_the_loop_thread_interrupts_the_waiting_caller(loop: LoopThread,
                                                                            request: pytest.FixtureRequest) -> None:
    assert threading.current_thread() is threading.main_thread()  # where Python runs signal handlers
    cancelled = threading.Event()

    async def long_call() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    # A shell's background job inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    timer = threading.Timer(0.3, signal.pthread_kill, (loop._thread.ident, signal.SIGINT))
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        loop.run(long_call())
    assert time.monotonic() - started < 20, "the caller was interrupted, not left waiting for the call to end"
    assert cancelled.is_set(), "the interrupted call was cancelled on the loop"


def test_a_timeout_and_the_calls_own_timeout_error_end_the_call(loop: LoopThread) -> None:
    with pytest.raises(TimeoutError):
        loop.run(asyncio.sleep(30), timeout=0.5)

    async def raises_timeout() -> None:
        raise TimeoutError("the call's own")

    with pytest.raises(TimeoutError, match="the call's own"):
        loop.run(raises_timeout())
    assert loop.run(asyncio.sleep(0.3, result=7)) == 7  # longer than one wait slice
