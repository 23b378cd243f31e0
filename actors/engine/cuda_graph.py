"""CUDA-graph-captured decode: capture the model's decode forward once per batch size, replay it each step.

Batch sizes form a ladder, 1, 2, 4, 8, then steps of 8 up to `max_bs` (which is always included). A decode
batch of `n` requests runs the graph of the smallest captured size `bs >= n`; the extra `bs - n` rows are
padding on the token table's scratch row (`TokenTable.scratch_row`): position 0, a KV length of 1, their K/V
written to the pool's scratch slot, which no request owns. So a padding row never writes a request's KV (two
rows writing one slot would race on a GPU) and attends over one key, not a request's whole context; its
logits are dropped. Inputs live in one set of static buffers (`GraphInputs`): `replay` takes table rows and
positions, gathers the input ids into the static buffer on the device from `TokenTable.ids` (where the step
before, possibly still in flight, wrote its sampled tokens) and copies the positions in; the attention
backend keeps its metadata in its own static buffers through the three graph hooks of `AttentionBackend`, so
this runner knows nothing of a particular backend. Every graph writes its logits into one shared
`[max_bs, vocab]` buffer.

Graphs are captured largest first, sharing one memory pool, with a progress bar; the capture's dummy
forwards run on the scratch row too, so a runner may be built while requests hold KV. Prefill and mixed
batches, and decode batches above `max_bs`, run eagerly (the model runner decides, with `can_run`).

Without CUDA (or with `capture=False`) nothing is captured: `replay` runs the same padded static-buffer
forward eagerly, so the padding and buffer logic can be checked against the plain eager forward on a CPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from actors.engine.llama import LlamaForCausalLM
from actors.engine.token_table import TokenTable
from kernels.attention import AttentionBackend, AttentionMetadata, ForwardInfo
from kernels.host_copy import to_device


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
    logits: torch.Tensor  # [max_bs, V] what every graph writes (one buffer, not one per size)

    @classmethod
    def allocate(cls, max_bs: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> GraphInputs:
        return cls(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=device),
            logits_index=torch.arange(max_bs, dtype=torch.int64, device=device),
            logits=torch.zeros(max_bs, vocab_size, dtype=dtype, device=device),
        )


class CudaGraphRunner:
    """Decode forwards for batches of up to `max_bs` requests, replayed from captured graphs."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        table: TokenTable,
        max_bs: int,
        capture: bool | None = None,
        progress: bool = True,
    ) -> None:
        """`capture`: None = capture when the table is on a CUDA device; False = eager replay (any device)."""
        if not backend.supports_cuda_graph:
            raise ValueError(f"{type(backend).__name__} does not implement the CUDA-graph hooks")
        self.model = model
        self.backend = backend
        self.table = table
        self.device = table.table.device
        self.sizes = batch_size_ladder(max_bs)
        self.max_bs = self.sizes[-1]
        if capture is None:
            capture = self.device.type == "cuda"
        if capture and self.device.type != "cuda":
            raise ValueError("capturing CUDA graphs needs the model on a CUDA device")
        self.captured = capture
        embed = model.model.embed_tokens.weight
        self.inputs = GraphInputs.allocate(self.max_bs, model.config.vocab_size, embed.dtype, self.device)
        backend.init_graph_buffers(self.max_bs, table.table)
        self.meta: dict[int, AttentionMetadata] = {bs: backend.prepare_for_capture(bs) for bs in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture_all(progress)

    def can_run(self, q_lens: Sequence[int]) -> bool:
        """Whether a batch with these per-request new-token counts runs here (decode only, not too large)."""
        return 0 < len(q_lens) <= self.max_bs and all(n == 1 for n in q_lens)

    def padded_size(self, n: int) -> int:
        """The captured size a batch of `n` decode requests runs at."""
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def replay(self, req_rows: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Logits `[n, V]` of one decode step: request `i` computes its token at `positions[i]` on table row
        `req_rows[i]`, whose slot is allocated and whose id is in `TokenTable.ids` by the time this runs on the
        device. The tensor is a view of a static output buffer: read it before the next replay."""
        n = len(req_rows)
        bs = self.padded_size(n)
        self._fill_inputs(bs, list(req_rows), list(positions))
        if self.captured:
            self.graphs[bs].replay()
        else:
            self._forward(bs)
        return self.inputs.logits[:n]

    def _fill_inputs(self, bs: int, req_rows: list[int], positions: list[int]) -> None:
        """Copy a step's inputs into the static buffers, padding `req_rows`/`positions` to `bs` rows on the
        scratch row (position 0, one key)."""
        pad = bs - len(req_rows)
        pos = positions + [0] * pad
        rows = req_rows + [self.table.scratch_row] * pad
        kv_lens_cpu = [p + 1 for p in pos]
        host = to_device([pos, rows, kv_lens_cpu], self.device)  # [3, bs], one non-blocking copy
        pos_t, rows_t = host[0], host[1]
        self.inputs.input_ids[:bs].copy_(self.table.ids[rows_t, pos_t])
        self.inputs.positions[:bs].copy_(pos_t)
        info = ForwardInfo(
            q_lens_cpu=[1] * bs,
            kv_lens_cpu=kv_lens_cpu,
            req_rows=rows_t,
            token_table=self.table.table,
            out_slots=self.table.table[rows_t, pos_t],
            kv_lens=host[2],
        )
        self.backend.prepare_for_replay(bs, info)

    def _forward(self, bs: int) -> torch.Tensor:
        """The static-buffer forward of size `bs` (what a graph captures): logits into the shared buffer."""
        i = self.inputs
        logits = self.model(i.input_ids[:bs], i.positions[:bs], self.backend, self.meta[bs], i.logits_index[:bs])
        return i.logits[:bs].copy_(logits)

    def _capture_all(self, progress: bool) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        sizes = list(reversed(self.sizes))  # largest first: smaller graphs fit in the memory it leaves
        bar = tqdm(sizes, desc="Capturing CUDA graphs", unit="graph", disable=not progress)
        for bs in bar:
            bar.set_postfix(bs=bs)
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
