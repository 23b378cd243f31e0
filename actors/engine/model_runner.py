"""Run one planned batch: lay it out as flat tensors, run the model with the attention backend, sample.

The runner reads the `Batch` and the token table and writes only the KV pool (through the backend); every
decision and allocation was made before it is called.
"""

from __future__ import annotations

import torch

from actors.engine.batch import Batch, ForwardOutput
from actors.engine.kv_pool import KVPool
from actors.engine.llama import LlamaForCausalLM
from actors.engine.token_table import TokenTable
from kernels.attention import AttentionBackend, ForwardInfo, create_backend
from kernels.sampling import sample


class ModelRunner:
    """Owns the model and its attention backend over a KV pool."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, table: TokenTable, backend: str) -> None:
        self.model = model
        self.table = table
        self.device = table.table.device
        self.backend: AttentionBackend = create_backend(backend, pool.k, pool.v, model.config.num_attention_heads)

    def forward(self, batch: Batch) -> ForwardOutput:
        """Compute the batch's tokens and sample the next token of each sampling row."""
        table_rows = [req.row for req in batch.reqs]
        positions = [p for start, n in zip(batch.starts, batch.extend_lens) for p in range(start, start + n)]
        row_of_token = [row for row, n in zip(table_rows, batch.extend_lens) for _ in range(n)]
        device = self.device
        positions_t = torch.tensor(positions, dtype=torch.int64, device=device)
        req_rows = torch.tensor(table_rows, dtype=torch.int64, device=device)
        info = ForwardInfo(
            q_lens_cpu=batch.extend_lens,
            kv_lens_cpu=[start + n for start, n in zip(batch.starts, batch.extend_lens)],
            req_rows=req_rows,
            token_table=self.table.table,
            out_slots=self.table.table[torch.tensor(row_of_token, device=device), positions_t],
        )
        ends = torch.tensor(batch.extend_lens, dtype=torch.int64).cumsum(0) - 1
        logits_index = ends[torch.tensor(batch.samples, dtype=torch.bool)].to(device)
        meta = self.backend.prepare(info)
        logits = self.model(torch.tensor(batch.input_ids, device=device), positions_t, self.backend, meta,
                            logits_index)
        rows = [req.sampling_row() for req in batch.sampling_reqs]
        if not rows:  # a step of prefill chunks only
            empty = torch.empty(0, dtype=torch.int64)
            return ForwardOutput(tokens=empty.to(device), tokens_cpu=empty)
        out = sample(logits, rows)
        non_blocking = device.type == "cuda"
        result = ForwardOutput(
            tokens=out.tokens,
            tokens_cpu=out.tokens.to("cpu", non_blocking=non_blocking),
            logprobs_cpu=None if out.logprobs is None else out.logprobs.to("cpu", non_blocking=non_blocking),
            top_ids_cpu=None if out.top_ids is None else out.top_ids.to("cpu", non_blocking=non_blocking),
            top_logprobs_cpu=None if out.top_logprobs is None else out.top_logprobs.to("cpu", non_blocking=non_blocking),
        )
        if non_blocking:
            result.copy_done = torch.cuda.Event()
            result.copy_done.record()
        return result
