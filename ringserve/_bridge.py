"""Synchronous and foreign-loop access to coroutines that run on one private event loop thread.

The `Engine` keeps its NATS connection (a `Client`) on its own loop thread, so blocking code, threads and other
event loops can all use it: `LoopThread.run` waits for a coroutine from any thread, and an interrupt (Ctrl-C)
or a timeout cancels it and waits for its cleanup (its requests are aborted) before it propagates.
`SyncStream` and `AsyncStream` iterate an async generator of that loop from a plain thread or from another
event loop; closing them early (or cancelling the reader) aborts what the generator was streaming.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Coroutine, Generator, Generic, Iterator, TypeVar

T = TypeVar("T")
CANCEL_GRACE_SECONDS = 10.0  # how long an interrupted call waits for its requests to be aborted
WAIT_SLICE_SECONDS = 0.2  # how soon a blocked call notices a Ctrl-C that another thread received


class LoopThread:
    """An asyncio event loop running on a daemon thread of its own."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = [task for task in asyncio.all_tasks(self.loop) if not task.done()]
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, awaitable: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Start `awaitable` on the loop; its future (thread-safe)."""
        async def call() -> T:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(call(), self.loop)

    def run(self, awaitable: Awaitable[T], timeout: float | None = None) -> T:
        """Run `awaitable` on the loop and return its result. If the caller is interrupted (KeyboardInterrupt)
        or `timeout` passes, it is cancelled, and its cleanup gets up to CANCEL_GRACE_SECONDS to finish."""
        if self.on_loop_thread():
            raise RuntimeError("a blocking Engine method was called from the Engine's own event loop")
        finished = threading.Event()

        async def guarded() -> T:
            try:
                return await awaitable
            finally:
                finished.set()

        future = asyncio.run_coroutine_threadsafe(guarded(), self.loop)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            # Waited in short slices: the kernel may hand Ctrl-C to the loop thread, and then only the main
            # thread's return to Python between slices runs the handler that raises KeyboardInterrupt here.
            while True:
                left = WAIT_SLICE_SECONDS if deadline is None else deadline - time.monotonic()
                try:
                    return future.result(max(min(left, WAIT_SLICE_SECONDS), 0.0))
                except concurrent.futures.TimeoutError:
                    if future.done() or (deadline is not None and time.monotonic() >= deadline):
                        raise  # the awaitable's own TimeoutError, or the caller's timeout
        except BaseException:
            if future.cancel():
                finished.wait(CANCEL_GRACE_SECONDS)
            raise

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop (cancelling whatever still runs on it) and wait for the thread to end."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.on_loop_thread():
            self._thread.join(timeout)


async def _step(iterator: AsyncIterator[T]) -> tuple[bool, T | None]:
    """One item of `iterator`, as (True, item), or (False, None) at its end (StopAsyncIteration stays here)."""
    try:
        return True, await iterator.__anext__()
    except StopAsyncIteration:
        return False, None


async def _close(source: AsyncIterator[Any]) -> None:
    """`source.aclose()`, once a step of it that is being cancelled has let go of it."""
    closer = getattr(source, "aclose", None)
    if closer is None:
        return
    for _ in range(500):
        try:
            await closer()
            return
        except RuntimeError:  # "aclose(): asynchronous generator is already running": its cancelled step
            await asyncio.sleep(0.01)


class SyncStream(Generic[T]):
    """A blocking iterator over an async generator running on a LoopThread; `close()` (or leaving a `with`
    block, or breaking out of a `for` and dropping it) stops the generator, aborting its requests."""

    def __init__(self, thread: LoopThread, source: AsyncIterator[T]) -> None:
        self._thread = thread
        self._source = source
        self._closed = False

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._closed:
            raise StopIteration
        try:
            more, item = self._thread.run(_step(self._source))
        except BaseException:
            self.close()
            raise
        if not more:
            self._closed = True
            raise StopIteration
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the stream now (its requests are aborted); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread.running:
            self._thread.run(_close(self._source))

    def __enter__(self) -> "SyncStream[T]":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class AsyncStream(Generic[T]):
    """An async iterator, for another event loop, over an async generator running on a LoopThread. Awaiting it
    gives itself (so `await engine.async_generate(..., stream=True)` works as in SGLang); cancelling the reader
    or `aclose()` stops the generator."""

    def __init__(self, thread: LoopThread, source: AsyncIterator[T]) -> None:
        self._thread = thread
        self._source = source
        self._closed = False

    def __aiter__(self) -> "AsyncStream[T]":
        return self

    async def __anext__(self) -> T:
        if self._closed:
            raise StopAsyncIteration
        try:
            more, item = await asyncio.wrap_future(self._thread.submit(_step(self._source)))
        except BaseException:
            await self.aclose()
            raise
        if not more:
            self._closed = True
            raise StopAsyncIteration
        return item  # type: ignore[return-value]

    async def aclose(self) -> None:
        """Stop the stream now (its requests are aborted); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread.running:
            await asyncio.wrap_future(self._thread.submit(_close(self._source)))

    def __await__(self) -> Generator[Any, None, "AsyncStream[T]"]:
        async def itself() -> "AsyncStream[T]":
            return self

        return itself().__await__()


def run_on(thread: LoopThread, coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
    """`coro` started on `thread`'s loop, awaitable from the caller's loop (cancelling the await cancels it)."""
    return asyncio.wrap_future(thread.submit(coro))
