"""Where a scheduler process runs torch: the model is built and every step runs on one thread.

Each thread that runs a parallel torch op gets an OpenMP team of its own from libgomp, kept while the thread
lives. With more OpenMP threads than cores, libgomp stops spinning between parallel regions, so every op then
waits for its workers to wake. Measured on 2 cores (one `gguf` decode step at batch 1): 32–34 ms when the
engine was built on the event loop's thread and stepped on another, 20.5–22 ms when built and stepped on the
same one. So the engine is built on the engine thread (`on_engine_thread`), and other torch work that cannot
wait for the steps (reading a checkpoint for a weight update) runs on a thread that ends with it
(`on_passing_thread`), taking its team along. The event loop's thread, which touches the engine between steps,
runs its torch ops serially (`serial_torch_on_this_thread`).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")
ENGINE_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


async def on_engine_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the engine thread (after the steps queued before it)."""
    return await asyncio.get_running_loop().run_in_executor(ENGINE_EXECUTOR, fn, *args)


def serial_torch_on_this_thread() -> None:
    """Run the calling thread's torch ops on one thread: the scheduler's event loop calls it once the engine is
    built. The loop adds, aborts and frees requests between steps, and a copy of more than 32k elements there
    (the KV pool's free-slot list) is a parallel op, which would give the loop's thread an OpenMP team of its
    own for the rest of the process's life: measured in one process on 2 cores, a batch-1 `gguf` step on two
    threads took 21-23 ms while such a team lived and 10-11 ms without (and the thread tuner then kept one
    stream on one thread). `torch.set_num_threads` also sets what a thread started later takes on its first
    parallel op, so this must come after the engine thread took its own (the model's load does)."""
    import torch

    torch.set_num_threads(1)


async def on_passing_thread(fn: Callable[..., T], *args: Any, name: str = "engine-side") -> T:
    """`fn(*args)` on a new thread that ends when it returns."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done
