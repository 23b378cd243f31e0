"""The `triton` attention backend: store-KV, paged decode and paged extend kernels from `kernels/triton`.

`prepare` moves the step's per-request lists to the device in one non-blocking copy; `forward` stores the
new K/V (Triton store kernel), then runs the split-KV decode kernel when every request brings one token and
the extend kernel otherwise, each with the layer's scale, sliding window and logit soft-cap (the kernels read only
the window's keys). CUDA-graph hooks keep the decode metadata in static buffers.

Needs CUDA tensors, or Triton's interpreter (`TRITON_INTERPRET=1` before `triton` is imported) on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Sequence

import torch

from ringserve.kernels.attention.backend import AttentionBackend, AttentionMetadata, ForwardInfo, LayerAttention
from ringserve.kernels.host_copy import to_device
from ringserve.kernels.triton import interpreter_enabled
from ringserve.kernels.triton.decode_attention import decode_attention, decode_buffers
from ringserve.kernels.triton.extend_attention import extend_attention
from ringserve.kernels.triton.store_kv import store_kv


@dataclass
class TritonMetadata(AttentionMetadata):
    """Device index tensors of one step (or static views of the graph buffers)."""

    token_table: torch.Tensor  # [R, L] int64
    req_rows: torch.Tensor  # [B] int64
    kv_lens: torch.Tensor  # [B] int32
    q_starts: torch.Tensor | None  # [B] int32 first flat token of each request (extend only)
    q_lens: torch.Tensor | None  # [B] int32 (extend only)
    max_q_len: int  # 1: all decode rows, run the decode kernel
    decode_scratch: tuple[torch.Tensor, torch.Tensor] | None  # split-KV partial outputs and lse (decode only)


class TritonBackend(AttentionBackend):
    """Paged attention with the Triton kernels of `kernels/triton`."""

    supports_cuda_graph = True

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int,
                 layers: Sequence[LayerAttention] | None = None) -> None:
        super().__init__(k_pool, v_pool, num_heads, layers)
        if k_pool.device.type != "cuda" and not interpreter_enabled():
            raise ValueError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 for tests)")
        self._graph: dict[str, torch.Tensor] = {}

    def prepare(self, info: ForwardInfo) -> TritonMetadata:
        q_lens, kv_lens = info.q_lens_cpu, info.kv_lens_cpu
        max_q = max(q_lens)
        device = self.k_pool.device
        if max_q == 1:
            lens = info.kv_lens.to(torch.int32) if info.kv_lens is not None else to_device(kv_lens, device, torch.int32)
            scratch = decode_buffers(len(q_lens), self.num_heads, self.head_dim, device)
            return TritonMetadata(info.out_slots, info.token_table, info.req_rows, lens, None, None, 1, scratch)
        starts, total = [], 0
        for n in q_lens:
            starts.append(total)
            total += n
        packed = to_device([starts, q_lens, kv_lens], device, torch.int32)  # [3, B], one copy
        return TritonMetadata(info.out_slots, info.token_table, info.req_rows, packed[2], packed[0], packed[1],
                              max_q, None)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert isinstance(meta, TritonMetadata)
        k_layer, v_layer = self.k_pool[layer], self.v_pool[layer]
        store_kv(k, v, k_layer, v_layer, meta.out_slots)
        spec = self.layers[layer]
        if meta.max_q_len == 1:
            return decode_attention(q, k_layer, v_layer, meta.token_table, meta.req_rows, meta.kv_lens, spec.scale,
                                    buffers=meta.decode_scratch, window=spec.window, logits_soft_cap=spec.soft_cap)
        assert meta.q_starts is not None and meta.q_lens is not None
        return extend_attention(q, k_layer, v_layer, meta.token_table, meta.req_rows, meta.q_starts, meta.q_lens,
                                meta.kv_lens, meta.max_q_len, spec.scale, window=spec.window,
                                logits_soft_cap=spec.soft_cap)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: int, meta: AttentionMetadata) -> None:
        store_kv(k, v, self.k_pool[layer], self.v_pool[layer], meta.out_slots)

    def init_graph_buffers(self, max_bs: int, token_table: torch.Tensor) -> None:
        device = self.k_pool.device
        self._graph = {
            "table": token_table,
            "rows": torch.zeros(max_bs, dtype=torch.int64, device=device),
            "kv_lens": torch.ones(max_bs, dtype=torch.int32, device=device),
            "out_slots": torch.zeros(max_bs, dtype=torch.int64, device=device),
        }
        self._scratch = decode_buffers(max_bs, self.num_heads, self.head_dim, device)

    def prepare_for_capture(self, bs: int) -> TritonMetadata:
        g = self._graph
        scratch = (self._scratch[0][:bs], self._scratch[1][:bs])
        return TritonMetadata(g["out_slots"][:bs], g["table"], g["rows"][:bs], g["kv_lens"][:bs], None, None, 1,
                              scratch)

    def prepare_for_replay(self, bs: int, info: ForwardInfo) -> None:
        g = self._graph
        g["rows"][:bs].copy_(info.req_rows)
        g["out_slots"][:bs].copy_(info.out_slots)
        if info.kv_lens is not None:
            g["kv_lens"][:bs].copy_(info.kv_lens)
        else:
            g["kv_lens"][:bs].copy_(to_device(info.kv_lens_cpu, self.k_pool.device, torch.int32))
