"""Decode steps from graphs: CUDA graphs captured on a GPU, `torch.compile` graphs on a CPU; one runner.

Batch sizes form a ladder, 1, 2, 4, 8, then steps of 8 up to `max_bs` (which is always included). A decode
batch of `n` requests runs the graph of the smallest size `bs >= n`; the extra `bs - n` rows are padding on
the token table's scratch row (`TokenTable.scratch_row`): position 0, a KV length of 1, their K/V written to
the pool's scratch slot, which no request owns. So a padding row never writes a request's KV (two rows writing
one slot would race on a GPU) and attends over one key, not a request's whole context; its logits are
dropped. Inputs live in one set of static buffers (`GraphInputs`): `replay` takes table rows and positions,
gathers the input ids into the static buffer on the device from `TokenTable.ids` (where the step before,
possibly still in flight, wrote its sampled tokens) and copies the positions in; the attention backend keeps
its metadata in its own static buffers through the three graph hooks of `AttentionBackend`, so this runner
knows nothing of a particular backend.

What "capture" means depends on the device (`mode`, the execution plan's `graph_mode`):
- `cuda_graph` (the plan's on a GPU): every size is captured at start, largest first, sharing one memory
  pool, with a log line as it starts and one as it ends (a bar would interleave with the other actors' log
  lines); the capture's dummy forwards run on the scratch row, so a runner may be built
  while requests hold KV. Every graph writes its logits into one shared `[max_bs, vocab]` buffer.
- `compile` (the plan's on a CPU): each size is compiled in the background (actors/engine/runner/graphs/graph_compiler.py)
  when a decode batch first needs it, size 1 as soon as `start_compiling` is called; until a size is ready,
  `can_run` says no and the model runner runs the step eagerly. A compiled size that measures slower than
  the eager forward stays eager.
- `eager`: nothing is captured, `replay` runs the same padded static-buffer forward eagerly, so the padding
  and buffer logic can be checked against the plain eager forward on any device.
Prefill and mixed batches, and decode batches above `max_bs`, always run eagerly (`can_run`).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from ringserve.actors.engine.runner.graphs.graph_compiler import BackgroundCompiler
from ringserve.actors.engine.models.causal_lm import CausalLM
from ringserve.actors.engine.runner.token_table import TokenTable
from ringserve.kernels.attention import AttentionBackend, AttentionMetadata, ForwardInfo
from ringserve.kernels.host_copy import to_device
from ringserve.observability.logging import log_event

log = logging.getLogger("engine.graphs")


def batch_size_ladder(max_bs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every multiple of 8 up to `max_bs`, and `max_bs` itself."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be at least 1, got {max_bs}")
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


@dataclass
class GraphInputs:
    """Static input buffers shared by every captured size; a graph of size `bs` reads the first `bs` rows."""

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    logits_index: torch.Tensor  # [max_bs] int64, arange: every decode row samples
    logits: torch.Tensor  # [max_bs, V] what every CUDA graph writes (one buffer; empty where none is captured)

    @classmethod
    def allocate(cls, max_bs: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> GraphInputs:
        """Buffers for `max_bs` rows; `vocab_size` 0 allocates no logits buffer (compiled graphs return theirs)."""
        return cls(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=device),
            logits_index=torch.arange(max_bs, dtype=torch.int64, device=device),
            logits=torch.zeros(max_bs, vocab_size, dtype=dtype, device=device),
        )


GRAPH_MODES = ("cuda_graph", "compile", "eager")


class DecodeStep(torch.nn.Module):
    """The decode forward over explicit inputs, as a module: what compile mode compiles. A compiled graph reads
    the parameters (and the attention backend) through its module when called, so a graph stored by one
    process runs another's weights when bound to its `DecodeStep` (actors/engine/runner/graphs/graph_store.py)."""

    def __init__(self, model: CausalLM, backend: AttentionBackend) -> None:
        super().__init__()
        self.model = model
        self.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_index: torch.Tensor) -> torch.Tensor:
        """Logits `[bs, V]` of one decode step."""
        return self.model(input_ids, positions, self.backend, meta, logits_index)


class DecodeGraphRunner:
    """Decode forwards for batches of up to `max_bs` requests, from captured or compiled graphs."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        table: TokenTable,
        max_bs: int,
        mode: str,
        progress: bool = True,
    ) -> None:
        """`mode`: `cuda_graph`, `compile`, `eager` (module docstring; the execution plan's `graph_mode`,
        actors/engine/execution_plan.py); `progress`: the capture's and the compiles' log lines at INFO (else DEBUG)."""
        if not backend.supports_cuda_graph:
            raise ValueError(f"{type(backend).__name__} does not implement the graph hooks")
        self.model = model
        self.backend = backend
        self.table = table
        self.device = table.table.device
        self.sizes = batch_size_ladder(max_bs)
        self.max_bs = self.sizes[-1]
        self.mode = mode
        if self.mode not in GRAPH_MODES:
            raise ValueError(f"unknown graph mode {self.mode!r}; choose one of {list(GRAPH_MODES)}")
        if self.mode == "cuda_graph" and self.device.type != "cuda":
            raise ValueError("capturing CUDA graphs needs the model on a CUDA device")
        self.step = DecodeStep(model, backend)
        vocab = 0 if self.mode == "compile" else model.vocab_size
        self.inputs = GraphInputs.allocate(self.max_bs, vocab, model.dtype, self.device)
        backend.init_graph_buffers(self.max_bs, table.table)
        self.meta: dict[int, AttentionMetadata] = {bs: backend.prepare_for_capture(bs) for bs in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.compiler: BackgroundCompiler | None = None
        if self.mode == "cuda_graph":
            self._capture_all(progress)
        elif self.mode == "compile":
            self._dummies = {bs: self._dummy_inputs(bs) for bs in self.sizes}  # taken before any step runs
            self.compiler = BackgroundCompiler(self.step, self._dummies.__getitem__, progress)
        self._compiling = False

    @property
    def captured(self) -> bool:
        """Whether steps replay captured CUDA graphs."""
        return self.mode == "cuda_graph"

    def start_compiling(self) -> None:
        """Compile mode: allow background compiles from now on, starting with size 1 on the calling thread's
        torch threads (the server calls this once it serves; engines built in-process compile nothing unless
        they call it). `RINGSERVE_CPU_GRAPHS=0` in the environment keeps every size eager (the test suite sets
        it, so that each server it starts does not spend its first minute compiling)."""
        if os.environ.get("RINGSERVE_CPU_GRAPHS", "1") == "0":
            return
        if self.compiler is not None and not self._compiling:
            self._compiling = True
            self.compiler.request((self.sizes[0], torch.get_num_threads()))

    def serving(self) -> AbstractContextManager[None]:
        """Wrap each engine step in this: in compile mode a compile running meanwhile gives way to it."""
        return self.compiler.serving() if self.compiler is not None else nullcontext()

    def report(self) -> dict[str, str]:
        """What runs each decode size: the mode, and in compile mode each requested graph's state (by size and
        torch threads)."""
        out = {"mode": self.mode, "max_bs": str(self.max_bs)}
        if self.compiler is not None:
            out.update(self.compiler.report())
        return out

    def changes(self) -> int:
        """Compile mode: a count that grows whenever a size starts to run another forward (a graph became ready
        or was demoted, or all were reset); 0 in the other modes, whose forwards never change."""
        return self.compiler.changes() if self.compiler is not None else 0

    def weights_changed(self) -> None:
        """Compile mode: recompile every compiled size in the background (eager until then) after the model's
        weights were swapped. CUDA graphs read the parameters in place and need nothing."""
        if self.compiler is not None:
            self.compiler.reset()

    def close(self) -> None:
        """Stop compiling (compile mode)."""
        if self.compiler is not None:
            self.compiler.close()

    def can_run(self, q_lens: Sequence[int]) -> bool:
        """Whether a batch with these per-request new-token counts runs here (decode only, not too large, and in
        compile mode its size ready; a size not yet asked for is queued for compiling)."""
        if not (0 < len(q_lens) <= self.max_bs and all(n == 1 for n in q_lens)):
            return False
        if self.compiler is None:
            return True
        key = (self.padded_size(len(q_lens)), torch.get_num_threads())  # the tuner set this step's threads
        if self.compiler.ready(key) is not None:
            return True
        if self._compiling:
            self.compiler.request(key)
        return False

    def padded_size(self, n: int) -> int:
        """The graph size a batch of `n` decode requests runs at."""
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def replay(self, req_rows: Sequence[int], positions: Sequence[int],
               rope_positions: Sequence[int] | None = None) -> torch.Tensor:
        """Logits `[n, V]` of one decode step: request `i` computes its token at `positions[i]` on table row
        `req_rows[i]`, whose slot is allocated and whose id is in `TokenTable.ids` by the time this runs on the
        device. `rope_positions`: what the model rotates by instead of `positions` (M-RoPE's shifted ones). The
        tensor may be a view of a static output buffer: read it before the next replay."""
        n = len(req_rows)
        bs = self.padded_size(n)
        rope = None if rope_positions is None else list(rope_positions)
        self._fill_inputs(bs, list(req_rows), list(positions), rope)
        if self.mode == "cuda_graph":
            self.graphs[bs].replay()
            return self.inputs.logits[:n]
        i = self.inputs
        if self.compiler is not None:
            key = (bs, torch.get_num_threads())
            forward = self.compiler.ready(key)
            assert forward is not None, f"decode graph {key} replayed before it was ready (can_run says when)"
            args = (i.input_ids[:bs], i.positions[:bs], self.meta[bs], i.logits_index[:bs])
            try:
                return forward(*args)[:n]
            except Exception as exc:  # raised before the graph ran: this size runs eagerly from now on
                self.compiler.demote(key, exc)
                return self.step.forward(*args)[:n]
        return self._forward(bs)[:n]

    def _fill_inputs(self, bs: int, req_rows: list[int], positions: list[int],
                     rope_positions: list[int] | None = None) -> None:
        """Copy a step's inputs into the static buffers, padding `req_rows`/`positions` to `bs` rows on the
        scratch row (position 0, one key). `positions` place the KV and bound attention; the model rotates by
        `rope_positions` when given, else by `positions`."""
        pad = bs - len(req_rows)
        pos = positions + [0] * pad
        rows = req_rows + [self.table.scratch_row] * pad
        kv_lens_cpu = [p + 1 for p in pos]
        rope = [] if rope_positions is None else [rope_positions + [0] * pad]
        host = to_device([pos, rows, kv_lens_cpu, *rope], self.device)  # [3 or 4, bs], one non-blocking copy
        pos_t, rows_t = host[0], host[1]
        self.inputs.input_ids[:bs].copy_(self.table.ids[rows_t, pos_t])
        self.inputs.positions[:bs].copy_(host[3] if rope else pos_t)
        info = ForwardInfo(
            q_lens_cpu=[1] * bs,
            kv_lens_cpu=kv_lens_cpu,
            req_rows=rows_t,
            token_table=self.table.table,
            out_slots=self.table.table[rows_t, pos_t],
            kv_lens=host[2],
        )
        self.backend.prepare_for_replay(bs, info)

    def _dummy_inputs(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Private copies of size `bs`'s inputs, every row padding, for compiling and timing off the static
        buffers (which the serving thread fills meanwhile)."""
        self._fill_inputs(bs, [], [])
        meta = self.meta[bs]
        # the token table is read, never written: shared, not copied (it is the real one, tens of MB, and a copy
        # per batch size cost seconds of every start)
        copies = {f.name: getattr(meta, f.name).clone() for f in dataclasses.fields(meta)
                  if isinstance(getattr(meta, f.name), torch.Tensor) and f.name != "table"}
        i = self.inputs
        return (i.input_ids[:bs].clone(), i.positions[:bs].clone(), dataclasses.replace(meta, **copies),
                i.logits_index[:bs].clone())

    def _forward(self, bs: int) -> torch.Tensor:
        """The static-buffer forward of size `bs` (what a CUDA graph captures): logits into the shared buffer."""
        i = self.inputs
        logits = self.step.forward(i.input_ids[:bs], i.positions[:bs], self.meta[bs], i.logits_index[:bs])
        return i.logits[:bs].copy_(logits)

    def _capture_all(self, progress: bool) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        sizes = list(reversed(self.sizes))  # largest first: smaller graphs fit in the memory it leaves
        level = logging.INFO if progress else logging.DEBUG
        log_event(log, level, "capturing CUDA graphs", graphs=len(sizes), largest_bs=sizes[0])
        started = time.perf_counter()
        for bs in sizes:
            self._fill_inputs(bs, [], [])  # every row padding: the dummy forwards touch only the scratch slot
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: compile kernels, settle allocations, outside the graph
                    self._forward(bs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        log_event(log, level, "captured CUDA graphs", graphs=len(sizes),
                  seconds=round(time.perf_counter() - started, 1))
