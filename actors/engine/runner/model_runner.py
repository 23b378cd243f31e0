"""Run one planned batch: lay it out as flat tensors, run the model with the attention backend, sample.

The runner reads the `Batch` and the token tables. Its input ids are gathered on the device from
`TokenTable.ids` (`ids[row_of_token, position]`, as the output slots are from the slot table), so a decode
token sampled by a step still in flight is read without the host having seen it. It writes the KV pool
(through the backend) and, right after sampling, each sampled token into `ids` for the next step; every
decision and allocation was made before it is called. Nothing here waits for the device. Decode-only
batches go through the decode graph runner (`decode_graph.py`: CUDA graphs on a GPU, compiled graphs on a
CPU) when the execution plan runs one and it has their size ready; prefill, mixed and oversized batches run eagerly.
The attention backend, the graph mode and row-invariant attention are the plan's (actors/engine/execution_plan.py);
the model was built with it, so the runner changes nothing in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ringserve.actors.engine.runner.graphs.fx_guard import no_fx_tracing
from ringserve.actors.engine.core.batch import Batch, ForwardOutput, PromptScores, rope_positions
from ringserve.actors.engine.core.embedding import hidden_positions, pool_chunk
from ringserve.actors.engine.execution_plan import ExecutionPlan
from ringserve.actors.engine.runner.graphs.decode_graph import DecodeGraphRunner
from ringserve.actors.engine.runner.kv_pool import KVPool
from ringserve.actors.engine.models.causal_lm import CausalLM
from ringserve.actors.engine.core.embed_override import EmbedOverride
from ringserve.actors.engine.models.rope import rope_lengths
from ringserve.actors.engine.runner.graphs.thread_tuner import ThreadTuner
from ringserve.actors.engine.runner.row_invariant import use_row_invariant_attention
from ringserve.actors.engine.runner.token_table import TokenTable
from ringserve.kernels.attention import AttentionBackend, ForwardInfo, create_backend
from ringserve.kernels.host_copy import to_device
from ringserve.kernels.sampling import sample, score_tokens


class ModelRunner:
    """Owns the model and its attention backend over a KV pool."""

    def __init__(self, model: CausalLM, pool: KVPool, table: TokenTable, plan: ExecutionPlan) -> None:
        """`plan`: the attention backend, and decode batches up to `plan.graph_max_bs` rows through a
        `DecodeGraphRunner` in `plan.graph_mode` (CUDA graphs, compiled graphs, or `eager` for tests on any device;
        `off` runs everything eagerly). `execution` is the plan run: without decode graphs where it asked for
        compiled ones over a backend that gathers (a model whose dtype is not the one the plan was resolved for)."""
        self.model = model
        self.table = table
        self.rope_rule = model.rope_length_rule  # a length-dependent rotary: each step's rows carry their floors
        self.thread_tuner: ThreadTuner | None = None
        self.device = table.table.device
        # this rank's heads: a tensor-parallel shard keeps 1/tp of them (actors/engine/parallel/tensor_parallel.py)
        self.backend: AttentionBackend = create_backend(plan.attention_backend, pool.k, pool.v, model.num_heads,
                                                        model.layer_attention())
        # tensor parallelism, rank 0: hands each eager forward's layout to the follower ranks first (tp_engine.py)
        self.tp_sender: Callable[..., None] | None = None  # (rows, starts, extend_lens, ids, info, override, rope_*=)
        self.graphs: DecodeGraphRunner | None = None
        self._graph_changes = 0  # `graphs.changes()` when the thread tuner last started learning
        # a CPU decode graph over a gathering attention path would be slower than eager at any context length
        if plan.graph_mode == "compile" and not self.backend.compiles_decode():
            plan = plan.with_graphs("off", 0)
        self.execution = plan
        if plan.graph_mode != "off":
            self.graphs = DecodeGraphRunner(model, self.backend, table, plan.graph_max_bs, plan.graph_mode)
        if plan.row_invariant:
            use_row_invariant_attention(self.backend, self.graphs is not None)

    def set_thread_policy(self, options: tuple[int, ...], large_from_tokens: int) -> None:
        """Run each step on one of `options` torch threads, learned per step size from measured step times
        (actors/engine/runner/graphs/thread_tuner.py); steps of `large_from_tokens` tokens or more are chunks."""
        self.thread_tuner = ThreadTuner(options, large_from_tokens)

    def forward(self, batch: Batch, mask: tuple[torch.Tensor, list[int]] | None = None) -> ForwardOutput:
        """Compute the batch's tokens and sample the next token of each sampling row (recorded in
        `TokenTable.ids`); all queued on the device, nothing waited for. `mask`: the packed grammar bitmask of
        the sampling rows and which of them it constrains (`GrammarManager.bitmask`)."""
        tuner = self.thread_tuner
        if tuner is not None:
            if self.graphs is not None and self.graphs.changes() != self._graph_changes:
                self._graph_changes = self.graphs.changes()
                tuner.forget()  # it timed another forward (thread_tuner.py)
            threads = tuner.choose(batch.num_tokens)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
            started = time.perf_counter()
        spans = batch.prompt_logit_spans()
        # One new token per request, each sampling (a 1-token chunk that does not sample runs eagerly); a
        # 1-token chunk never scores a prompt token (it is the prompt's last, which predicts the output).
        embeds = [req.embed for req in batch.reqs]
        hidden_plan = hidden_positions(embeds, batch.starts, batch.extend_lens, batch.samples) if any(embeds) else []
        with no_fx_tracing():  # a graph compiling in the background must not trace meanwhile (fx_guard.py)
            if hidden_plan:
                logits = self._forward_eager(batch, spans, hidden_plan)
            elif (batch.override is None and self.graphs is not None and all(batch.samples)
                  and self.graphs.can_run(batch.extend_lens)):
                logits = self.graphs.replay(batch.rows, batch.starts, rope_positions(batch))
            else:
                logits = self._forward_eager(batch, spans)
        num_sampling = sum(batch.samples)
        out = self._sample(batch, logits[:num_sampling], mask)
        if spans:
            out.prompt = self._score_prompt(batch, spans, logits[num_sampling:])
        if self.device.type == "cuda":  # after every host copy of this step was queued
            out.copy_done = torch.cuda.Event()
            out.copy_done.record()
        if tuner is not None:  # on the CPU the step has run by now: its wall time is its cost
            tuner.record(batch.num_tokens, threads, time.perf_counter() - started)
        return out

    def _forward_eager(self, batch: Batch, spans: list[tuple[int, int, int]] | None = None,
                       hidden_plan: list[tuple[int, int, int]] | None = None) -> torch.Tensor:
        """Logits `[S + E, V]`: of the batch's sampling rows, then of the `E` positions in `spans` (prompt
        tokens to score, `Batch.prompt_logit_spans`), through `backend.prepare` and the model. `hidden_plan`:
        the embedding rows' positions (`embedding.hidden_positions`), whose final-norm hidden states are pooled
        into their requests."""
        device = self.device
        positions_t, rows_t, info = self._layout(batch.rows, batch.starts, batch.extend_lens)
        input_ids = self.table.ids[rows_t, positions_t]
        rope = rope_positions(batch)  # M-RoPE: the model rotates by these, the KV slots stay the positions
        rope_t = positions_t if rope is None else to_device(rope, device)
        ends = torch.tensor(batch.extend_lens, dtype=torch.int64).cumsum(0) - 1
        index = ends[torch.tensor(batch.samples, dtype=torch.bool)].tolist()
        for b, first, count in spans or ():
            offset = int(ends[b]) - batch.extend_lens[b] + 1 - batch.starts[b]  # flat index of position 0
            index += range(offset + first, offset + first + count)
        logits_index = to_device(index, device)
        floors = [req.rope_floor for req in batch.reqs] if self.rope_rule is not None else None
        if self.tp_sender is not None:
            self.tp_sender(batch.rows, batch.starts, batch.extend_lens, input_ids, info, batch.override,
                           rope_floors=floors, rope_positions=rope)
        meta = self.backend.prepare(info)
        lengths = rope_lengths(positions_t, batch.extend_lens, floors)
        if not hidden_plan:
            return self.model(input_ids, rope_t, self.backend, meta, logits_index, override=batch.override,
                              rope_lengths=lengths)
        hidden_index = to_device([at + i for _, at, count in hidden_plan for i in range(count)], device)
        logits, hidden = self.model(input_ids, rope_t, self.backend, meta, logits_index, hidden_index,
                                    override=batch.override, rope_lengths=lengths)
        taken = 0
        for b, _, count in hidden_plan:
            state = batch.reqs[b].embed
            assert state is not None
            pool_chunk(state, batch.starts[b], hidden[taken:taken + count])
            taken += count
        return logits

    def _layout(self, table_rows: list[int], starts: list[int],
                extend_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, ForwardInfo]:
        """Positions and table row of each of the step's tokens `[T]`, and the attention backend's input."""
        positions = [p for start, n in zip(starts, extend_lens) for p in range(start, start + n)]
        row_of_token = [row for row, n in zip(table_rows, extend_lens) for _ in range(n)]
        device = self.device
        # Host lists reach the device in non-blocking copies from pinned memory: no host sync on a GPU.
        flat = to_device([positions, row_of_token], device)  # [2, T]
        positions_t, rows_t = flat[0], flat[1]
        info = ForwardInfo(
            q_lens_cpu=extend_lens,
            kv_lens_cpu=[start + n for start, n in zip(starts, extend_lens)],
            req_rows=to_device(table_rows, device),
            token_table=self.table.table,
            out_slots=self.table.table[rows_t, positions_t],
        )
        return positions_t, rows_t, info

    def forward_tokens(self, table_rows: list[int], starts: list[int], extend_lens: list[int],
                       input_ids: torch.Tensor, override: EmbedOverride | None = None,
                       rope_floors: list[int] | None = None, rope_positions: list[int] | None = None) -> None:
        """A tensor-parallel follower's forward: rank 0's layout over `input_ids` (the token table's rows
        already hold rank 0's slots), writing this rank's KV and taking part in the all-reduces; no logits.
        `override`: rank 0's image embeddings of the step; `rope_floors`: each row's `Req.rope_floor` (a
        length-dependent rotary); `rope_positions`: each token's M-RoPE position (`images.rope_positions`)."""
        positions_t, _, info = self._layout(table_rows, starts, extend_lens)
        rope_t = positions_t if rope_positions is None else to_device(rope_positions, self.device)
        meta = self.backend.prepare(info)
        lengths = rope_lengths(positions_t, extend_lens, rope_floors)
        with no_fx_tracing():
            self.model(input_ids, rope_t, self.backend, meta, torch.empty(0, dtype=torch.int64, device=self.device),
                       override=override, rope_lengths=lengths)

    def _sample(self, batch: Batch, logits: torch.Tensor,
                mask: tuple[torch.Tensor, list[int]] | None = None) -> ForwardOutput:
        """Sample the sampling rows' next tokens, write them to `TokenTable.ids` and start their copy to the
        host."""
        device = self.device
        rows = batch.sampling_rows()
        if not rows:  # a step of prefill chunks only
            empty = torch.empty(0, dtype=torch.int64)
            return ForwardOutput(tokens=empty.to(device), tokens_cpu=empty)
        out = sample(logits, rows, mask)
        # Each row's new token goes right after the ones it computed: the next step reads it there.
        sampled = [b for b, s in enumerate(batch.samples) if s]
        where = to_device([[batch.reqs[b].row for b in sampled],
                           [batch.starts[b] + batch.extend_lens[b] for b in sampled]], device)  # [2, S]: row, column
        self.table.ids[where[0], where[1]] = out.tokens
        non_blocking = device.type == "cuda"
        result = ForwardOutput(
            tokens=out.tokens,
            tokens_cpu=out.tokens.to("cpu", non_blocking=non_blocking),
            logprobs_cpu=None if out.logprobs is None else out.logprobs.to("cpu", non_blocking=non_blocking),
            top_ids_cpu=None if out.top_ids is None else out.top_ids.to("cpu", non_blocking=non_blocking),
            top_logprobs_cpu=None if out.top_logprobs is None else out.top_logprobs.to("cpu", non_blocking=non_blocking),
        )
        return result


    def _score_prompt(self, batch: Batch, spans: list[tuple[int, int, int]], logits: torch.Tensor) -> PromptScores:
        """Score the prompt tokens that the logits of `spans`' positions predict (the token after each)."""
        targets = [batch.reqs[b].ids[p + 1] for b, first, count in spans for p in range(first, first + count)]
        k = max(batch.reqs[b].params.top_logprobs_num for b, _, _ in spans)
        scored = score_tokens(logits, to_device(targets, self.device), k)
        non_blocking = self.device.type == "cuda"

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to("cpu", non_blocking=non_blocking)

        return PromptScores(spans, host(scored.logprobs), host(scored.ranks), host(scored.top_ids),
                            host(scored.top_logprobs))  # type: ignore[arg-type]

