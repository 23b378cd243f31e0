"""Compiled CPU decode graphs: `torch.compile` of the decode forward per batch size, built in the background.

What a CUDA graph is on a GPU, a compiled graph is on a CPU: the whole decode forward of one padded batch size
as one graph (`fullgraph=True, dynamic=False`), Inductor fusing the small ops between the linears and running
them without Python in between. The linears and attention stay our custom ops (kernels/cpu, with fake
implementations so they trace), and the KV write is `torch.ops.ringserve.store_kv`, which mutates the pool in
place. What is compiled is a module whose `forward(*inputs)` is the decode forward (`DecodeStep`,
actors/engine/runner/graphs/decode_graph.py), so that a stored graph can be bound to another engine's module when loaded.

Compiling takes tens of seconds per size on a small CPU, so it never blocks serving: `request((bs, threads))`
queues a size (the decode graph runner asks for one when a batch first needs it), one daemon thread compiles queued
sizes in turn, smallest first, and until a size is ready its steps run eagerly. The compile thread gives way to
the steps served meanwhile (`serving()`, kernels/cpu/give_way.py): it runs Python in the gaps between steps
and in short slices during them, so a step is not made to wait for the GIL. Each compile is warmed up on
private dummy inputs (padding rows on the scratch slot, so it touches no request's KV or static buffer), then
timed side by side with the eager forward on the same inputs; the faster is kept, so a size where compiling
does not pay stays eager. Each graph is compiled with Dynamo's ahead-of-time entry point and kept on
disk (actors/engine/runner/graphs/graph_store.py), so a restart on the same host, torch, code and model loads it in about
three seconds instead of tracing the model again (20-35 s per graph even when Inductor's caches, under
`$RINGSERVE_CACHE/inductor` unless `TORCHINDUCTOR_CACHE_DIR` is set, hit). A graph runs only on the torch
thread count it was compiled with (its guards hold the count, which Inductor plans its parallel loops for), so
the key of a graph is `(bs, threads)`: the thread tuner's two counts are two graphs, each compiled when first
needed. A graph's guards are checked once, when it is compiled or loaded; a replay skips them, since the runner picks
the graph by its key and feeds it the same static buffers every step.

A size that fails to compile (or whose graph fails when replayed) runs eagerly, and the log and
`/get_server_info` name the exception. `RINGSERVE_GRAPH_FALLBACK=error` (what the test suite sets, tests/conftest.py)
makes that an error instead: the step that would run the failed size raises `GraphFailed`, so no test passes
on a silently eager graph.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ringserve.actors.engine.runner.graphs.graph_store import GraphStore
from ringserve.kernels.cpu import cache_dir
from ringserve.kernels.cpu.give_way import give_way_to_steps, stepping
from ringserve.kernels.cpu.host import time_interleaved
from ringserve.observability.logging import log_event

log = logging.getLogger("engine.graphs")

Forward = Callable[..., torch.Tensor]
GraphKey = tuple[int, int]  # (batch size, torch threads)
FALLBACK_ENV = "RINGSERVE_GRAPH_FALLBACK"  # "eager" (default) or "error"


class GraphFailed(RuntimeError):
    """A decode graph failed to compile or replay while eager fallbacks are an error (`FALLBACK_ENV`)."""


def fallback_allowed() -> bool:
    """Whether a size whose graph failed may run eagerly (`RINGSERVE_GRAPH_FALLBACK`, default "eager")."""
    return os.environ.get(FALLBACK_ENV, "eager") != "error"


def describe(exc: BaseException) -> str:
    """An exception for a report or a log line: its type and first line, at most 200 characters."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"[:200]


def label(key: GraphKey) -> str:
    """How a graph is named in reports and logs: "bs 8, 2 threads"."""
    bs, threads = key
    return f"bs {bs}, {threads} thread{'s' if threads > 1 else ''}"


def configure_inductor() -> None:
    """Keep Inductor's on-disk caches with ringserve's (`$RINGSERVE_CACHE/inductor`) unless the user chose, and
    compile in this process: a pool of compile workers would take the cores serving needs, and outlive a
    scheduler that is killed."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1


def compile_options() -> dict[str, object]:
    """Inductor's options for a decode graph. Guards: only those that can be stored and checked again in
    another process (tensor layouts, torch's global state such as the thread count, shapes) are kept, and they
    are checked when a graph is compiled or loaded, not per step (checked on every call, with every
    parameter's layout among them, they cost a batch-1 forward 13-16%, bench/compile_options.py). Skipped too:
    the wrapper's checks of every input's and op output's size, stride and alignment (~580 Python calls a step;
    1.15-1.21x faster at batch 1 without, bench/compile_options.py): the parameters keep their shapes (a
    weight swap compiles again) and our ops' outputs are what their fake implementations say."""
    return {"guard_filter_fn": torch.compiler.keep_portable_guards_unsafe, "size_asserts": False,
            "alignment_asserts": False}


def compile_graph(module: torch.nn.Module, inputs: tuple[Any, ...],
                  options: dict[str, object] | None = None) -> Any:
    """`module.forward` compiled whole for `inputs` (`fullgraph`, static shapes) with Dynamo's ahead-of-time
    entry point: a function called as `graph(module, *inputs)` that `GraphStore` can save and load."""
    compiled = torch.compile(module.forward, fullgraph=True, dynamic=False, options=options or compile_options())
    return compiled.aot_compile((inputs, {}))


def bind(graph: Any, module: torch.nn.Module) -> Forward:
    """A compiled or loaded `graph` as a forward over the inputs alone, its guards no longer checked per call
    (the module docstring says why)."""
    graph.disable_guard_check()

    def forward(*inputs: Any) -> torch.Tensor:
        return graph(module, *inputs)

    return forward


class BackgroundCompiler:
    """Compiles `module` for batch sizes on request, in one background thread; `ready(key)` gives the result.

    A key is `(bs, threads)`: a compiled graph runs only on the torch thread count it was compiled for (its
    guards hold it), and the thread tuner runs a size on either count, so each is its own graph.
    `module.forward(*inputs)` is the decode forward of `len` rows; `dummy_inputs(bs)` gives private inputs of
    `bs` padding rows for warming up and timing. Graphs that measure slower than the eager forward are recorded
    as eager (`ready` returns `module.forward` itself for them), unless `choose` is False (tests: keep every
    compiled forward). Graphs are loaded from and saved to a `GraphStore` (`RINGSERVE_GRAPH_STORE=0`: neither).
    Progress is log lines, one as each compile starts (with `progress`; DEBUG without) and one as it ends, never
    a redrawn bar: the compiles run for minutes after the ring is ready, in an actor that shares its terminal
    with every other actor's log lines.
    """

    def __init__(self, module: torch.nn.Module, dummy_inputs: Callable[[int], tuple[Any, ...]],
                 progress: bool = True, time_rounds: int = 3, choose: bool = True) -> None:
        self.module = module
        self.forward: Forward = module.forward
        self._store: GraphStore | None = None  # made when first needed, again after a reset (new weights)
        self.choose = choose
        self.dummy_inputs = dummy_inputs
        self.progress = progress
        self.time_rounds = time_rounds
        self._compiled: dict[GraphKey, Forward] = {}
        self._report: dict[GraphKey, dict[str, Any]] = {}
        self._queue: list[GraphKey] = []
        self._requested: set[GraphKey] = set()
        self._wake = threading.Condition()
        self._generation = 0  # bumped by reset(): a compile started before it is stale
        self._changes = 0  # bumped whenever what some size runs changes (changes())
        self._closed = False
        self._thread: threading.Thread | None = None

    def request(self, key: GraphKey) -> None:
        """Queue `(bs, threads)` for compiling (once; a no-op when it is queued, compiling or done)."""
        with self._wake:
            if key in self._requested or self._closed:
                return
            self._requested.add(key)
            self._queue.append(key)
            self._queue.sort()
            if self._thread is None:
                self._start()
            self._wake.notify()

    def ready(self, key: GraphKey) -> Forward | None:
        """The forward to run `(bs, threads)` with (compiled, or the eager one where it measured faster), or
        None while it is not ready. Raises GraphFailed for a size that failed while fallbacks are an error."""
        failure = self._report.get(key, {}).get("failed")
        if failure and not fallback_allowed():
            raise GraphFailed(f"decode graph {label(key)} failed to compile ({failure}); {FALLBACK_ENV}=error "
                              "forbids running it eagerly")
        return self._compiled.get(key)

    def changes(self) -> int:
        """A count that grows whenever what some size runs changes: a graph became ready (compiled, eager or
        failed), one was demoted, or `reset` forgot them all. Step times measured before it changed timed
        another forward (the thread tuner relearns, actors/engine/runner/model_runner.py)."""
        return self._changes

    def report(self) -> dict[str, str]:
        """Per size: "compiled (1.6x, 41 s)", "eager (compiled 0.9x)", "compiling", "queued" or "failed: ..."."""
        with self._wake:
            states = {key: "queued" for key in self._queue}
            states.update({key: r["state"] for key, r in self._report.items()})
        return {label(key): state for key, state in sorted(states.items())}

    def serving(self) -> AbstractContextManager[None]:
        """Wrap each step served in this: while a compile runs, its thread gives way to the step's Python
        (kernels/cpu/give_way.cpp; without it a compile stalled steps for seconds)."""
        return stepping(self._thread is not None)

    def wait(self, key: GraphKey, timeout: float) -> bool:
        """Block until `(bs, threads)` is ready or failed (tests, benchmarks); whether it is ready."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while key not in self._compiled and not self._report.get(key, {}).get("failed"):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
        return key in self._compiled

    def demote(self, key: GraphKey, exc: Exception) -> None:
        """Run `(bs, threads)` eagerly from now on: its compiled forward failed on the serving thread (`exc`)."""
        if not fallback_allowed():
            raise GraphFailed(f"decode graph {label(key)} failed when replayed ({describe(exc)}); "
                              f"{FALLBACK_ENV}=error forbids running it eagerly") from exc
        log_event(log, logging.WARNING, "compiled decode graph failed when replayed; this size runs eagerly",
                  graph=label(key), error=describe(exc))
        with self._wake:
            self._compiled[key] = self.forward
            self._report[key] = {"state": f"eager (replay failed: {describe(exc)})"}
            self._changes += 1

    def reset(self) -> None:
        """Forget every compiled size and compile the ones asked for again (after the model's weights were
        swapped: a quantized layer is a new module then, and a graph must not recompile on the serving thread).
        A compile in progress is discarded when it ends."""
        with self._wake:
            self._generation += 1
            self._changes += 1
            self._store = None  # the new weights may have another layout
            self._compiled.clear()
            self._report.clear()
            self._queue = sorted(self._requested)
            if self._thread is None and self._queue:
                self._start()
            self._wake.notify_all()

    def close(self) -> None:
        """Compile nothing more (a compile in progress finishes in its daemon thread)."""
        with self._wake:
            self._closed = True
            self._queue.clear()
            self._wake.notify_all()

    def _start(self) -> None:
        """Start a compile thread (under `_wake`). It ends when the queue is empty, and the next request starts
        another: an idle thread that ran torch ops keeps its own OpenMP team, and with more OpenMP threads than
        cores libgomp stops spinning between parallel regions, so every op of the serving thread then waits for
        its workers to wake (a q8_0 GEMV at one row: 16.6 µs, 62.7 µs while an idle compile thread lived)."""
        self._thread = threading.Thread(target=self._run, name="decode-graph-compiler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # on this thread, not the caller's: importing Inductor and Dynamo takes 2-7 s on a 2-core host, which
        # the scheduler spent before it was ready when `_start` did it
        configure_inductor()
        give_way_to_steps(True)
        while True:
            with self._wake:
                if not self._queue or self._closed:
                    self._thread = None
                    give_way_to_steps(False)
                    return
                key = self._queue.pop(0)
                self._report[key] = {"state": "compiling"}
                generation = self._generation
                queued = len(self._queue)
            log_event(log, logging.INFO if self.progress else logging.DEBUG,
                      "compiling decode graph in the background (steps run eagerly until it is ready)",
                      graph=label(key), queued_after=queued)
            try:
                chosen, state = self._compile(key)
                entry: dict[str, Any] = {"state": state}
            except Exception as exc:  # a size that does not compile stays eager; the server keeps serving
                log_event(log, logging.WARNING, "decode graph failed to compile; this size runs eagerly",
                          graph=label(key), error=describe(exc))
                chosen, entry = self.forward, {"state": f"failed: {describe(exc)}", "failed": describe(exc)}
            with self._wake:
                if generation != self._generation:  # reset() meanwhile: it queued this size again
                    continue
                self._compiled[key] = chosen
                self._report[key] = entry
                self._changes += 1
                self._wake.notify_all()

    def _graph_store(self) -> GraphStore:
        """The store for the module's current weights' layout."""
        if self._store is None:
            self._store = GraphStore(self.module, compile_options())
        return self._store

    def _compile(self, key: GraphKey) -> tuple[Forward, str]:
        """Compile `(bs, threads)`, warm it up, time it against eager: the forward to keep and its report line."""
        bs, threads = key
        torch.set_num_threads(threads)  # this thread's own setting, which the graph is guarded on
        started = time.perf_counter()
        inputs = self.dummy_inputs(bs)
        store = self._graph_store()
        graph = store.load(key, inputs)
        loaded = graph is not None
        if graph is None:
            graph = compile_graph(self.module, inputs)
            store.save(key, inputs, graph)
        compiled = bind(graph, self.module)
        compiled(*inputs)
        seconds = time.perf_counter() - started
        times = time_interleaved({"compiled": lambda: compiled(*inputs), "eager": lambda: self.forward(*inputs)},
                                 rounds=self.time_rounds)
        speedup = times["eager"] / times["compiled"]
        keep = speedup > 1.0 or not self.choose
        log_event(log, logging.INFO, "decode graph compiled", graph=label(key), seconds=round(seconds, 1),
                  speedup=round(speedup, 2), runs="compiled" if keep else "eager",
                  source="stored" if loaded else "traced")
        if keep:
            return compiled, f"compiled ({speedup:.2f}x, {seconds:.0f} s{', stored' if loaded else ''})"
        return self.forward, f"eager (compiled {speedup:.2f}x)"
