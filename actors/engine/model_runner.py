"""Run one forward step for a batch of requests: lay out the flat batch, take KV slots, forward, sample."""

from __future__ import annotations

import torch

from actors.engine.kv_cache import KVCache
from actors.engine.llama import LlamaForCausalLM, head_dim_of
from actors.engine.request import Request
from kernels.attention import AttentionBackend, TorchPagedBackend
from kernels.sampling import sample


class ModelRunner:
    """Owns the model, its KV cache and attention backend; turns a list of requests into one token each."""

    def __init__(
        self, model: LlamaForCausalLM, num_slots: int, max_requests: int, max_len: int, device: torch.device
    ) -> None:
        config = model.config
        self.model = model
        self.device = device
        self.kv_cache = KVCache(
            num_layers=config.num_hidden_layers,
            num_slots=num_slots,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim_of(config),
            max_requests=max_requests,
            max_len=max_len,
            dtype=model.lm_head.weight.dtype,
            device=device,
        )
        self.backend: AttentionBackend = TorchPagedBackend(
            self.kv_cache.k, self.kv_cache.v, config.num_attention_heads
        )

    def step(self, batch: list[Request]) -> list[int]:
        """Feed each request's uncached tokens, store their K/V, and return each request's next token.

        Every request in `batch` must hold a page-table row; its `num_cached` advances past the fed tokens.
        """
        rows: list[int] = []
        starts: list[int] = []
        q_lens: list[int] = []
        input_ids: list[int] = []
        positions: list[int] = []
        for req in batch:
            if req.row is None:
                raise ValueError(f"request {req.rid} has no page-table row")
            rows.append(req.row)
            starts.append(req.num_cached)
            q_lens.append(req.num_new)
            input_ids.extend(req.new_ids())
            positions.extend(range(req.num_cached, req.seq_len))
        kv_lens = [start + n for start, n in zip(starts, q_lens)]
        out_slots = self.kv_cache.append(rows, starts, q_lens)
        kv_slots = self.kv_cache.page_rows(rows, max(kv_lens))
        meta = self.backend.prepare(q_lens, kv_lens, kv_slots, out_slots)
        logits = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.backend,
            meta,
        )
        for req, kv_len in zip(batch, kv_lens):
            req.num_cached = kv_len
        return sample(logits, [req.sampling_row() for req in batch])
