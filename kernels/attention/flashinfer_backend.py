"""The `flashinfer` attention backend: FlashInfer's paged prefill and decode wrappers (PyPI `flashinfer-python`).

The page-size-1 pool is FlashInfer's paged layout with one token per page, NHD: one layer of the pool,
`[num_slots, Hkv, D]`, viewed as `[num_pages, 1, Hkv, D]`. A request's pages are its table row's first
`kv_len` slots: `kv_indptr` is the running sum of the lengths (built on the host, where the lengths are
known), `kv_indices` the rows flattened on the device by a Triton kernel, and every `last_page_len` is 1.

`prepare` plans the decode wrappers when every request brings one token and the prefill wrappers (causal,
queries aligned to the end of each request's keys) otherwise; `forward` stores the new K/V and calls `run()`.
FlashInfer fixes the softmax scale, the sliding window (`window_left`, inclusive: HF's window minus one) and the
logit soft-cap at plan time, so there is one decode and one prefill wrapper per distinct `LayerAttention` of the
model (a Llama has one, a Gemma 2 two: sliding and global), each planned every step over the same index
layout, and a layer runs its own spec's wrapper. A windowed wrapper reads only the window's keys.
For CUDA graphs there is one set of decode wrappers per captured batch size (FlashInfer fixes the batch size of
a graph-mode wrapper), all over the same static index buffers, re-planned before each replay. Every `plan()`
goes through a `ReplanGuard` (a wrapper is never re-planned before its last plan's copy ran) and gets its host
index tensors in pinned memory.

FlashInfer's kernels take float16/bfloat16 only. GPU only; imported only when the backend is created, and this
module imports without the package (creating the backend then raises).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

try:
    import flashinfer
except ImportError:  # the backend is registered only where it is installed; this keeps the module importable
    flashinfer = None

from ringserve.kernels.attention.backend import AttentionBackend, AttentionMetadata, ForwardInfo, LayerAttention
from ringserve.kernels.attention.plan_guard import ReplanGuard
from ringserve.kernels.host_copy import host_to_device, to_device
from ringserve.kernels.triton.kv_indices import build_kv_indices

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-KV partial results)
# FlashAttention-2 kernels for every wrapper: "auto" may pick FA3 prefill on Hopper, a second, much longer JIT
# build on first use, for no gain in decode.
KERNELS = "fa2"


@dataclass
class FlashInferMetadata(AttentionMetadata):
    """The planned wrappers, one per distinct layer spec (`FlashInferBackend.specs` order): a layer calls its
    spec's `run()`."""

    wrappers: tuple[Any, ...] = ()  # BatchDecodeWithPagedKVCacheWrapper or BatchPrefillWithPagedKVCacheWrapper


class FlashInferBackend(AttentionBackend):
    """Paged attention through FlashInfer's wrappers."""

    supports_cuda_graph = True

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int,
                 layers: Sequence[LayerAttention] | None = None) -> None:
        super().__init__(k_pool, v_pool, num_heads, layers)
        if v_pool is k_pool:
            raise ValueError("the flashinfer attention backend does not run latent attention (one latent of "
                             f"{k_pool.shape[-1]} values per token, DeepSeek's MLA): use --attention-backend triton")
        if flashinfer is None:
            raise ValueError("the flashinfer attention backend needs the flashinfer package (flashinfer-python)")
        if k_pool.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        if k_pool.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flashinfer kernels take float16 or bfloat16 KV, not {k_pool.dtype} (use --dtype)")
        self.device = k_pool.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # Tensor cores pay off once several query heads share a KV head.
        self.use_tensor_cores = num_heads // self.num_kv_heads >= 4
        # the distinct specs of the layers, and each layer's index into them; the wrappers share the workspace
        # (their runs are sequential on one stream)
        self.specs: tuple[LayerAttention, ...] = tuple(dict.fromkeys(self.layers))
        self.spec_index = [self.specs.index(spec) for spec in self.layers]
        self._decode = [flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores, backend=KERNELS) for _ in self.specs]
        self._prefill = [flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=KERNELS)
                         for _ in self.specs]
        self._graph: dict[str, Any] = {}
        self._guard = ReplanGuard(torch.cuda.Event)

    def _layout(self, info: ForwardInfo, indices: torch.Tensor | None = None,
                indptr_dev: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`kv_indptr` (host int32 `[B + 1]`), `kv_indices` (device int32) and `last_page_len` (host, ones)."""
        batch = len(info.kv_lens_cpu)
        indptr = _running_sum(info.kv_lens_cpu)
        total = int(indptr[-1])
        kv_lens = info.kv_lens if info.kv_lens is not None else to_device(info.kv_lens_cpu, self.device)
        if indptr_dev is None:
            indptr_dev = host_to_device(indptr, self.device)
        else:  # the static buffer: entry 0 stays 0, the rest is the running sum, computed on the device
            indptr_dev[1 : batch + 1].copy_(torch.cumsum(kv_lens, 0, dtype=torch.int32))
        if indices is None:
            indices = torch.empty(total, dtype=torch.int32, device=self.device)
        build_kv_indices(info.token_table, info.req_rows, indptr_dev, kv_lens, indices)
        return indptr, indices[:total], torch.ones(batch, dtype=torch.int32).pin_memory()

    def _plan_decode(self, wrappers: Sequence[Any], indptr: torch.Tensor, indices: torch.Tensor,
                     last: torch.Tensor) -> None:
        """Plan each spec's decode wrapper over the same layout."""
        for wrapper, spec in zip(wrappers, self.specs):
            self._guard.plan(id(wrapper), lambda wrapper=wrapper, spec=spec: wrapper.plan(
                indptr, indices, last, num_qo_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, page_size=1, q_data_type=self.k_pool.dtype, kv_data_type=self.k_pool.dtype,
                **_spec_args(spec)))

    def prepare(self, info: ForwardInfo) -> FlashInferMetadata:
        indptr, indices, last = self._layout(info)
        if max(info.q_lens_cpu) == 1:
            self._plan_decode(self._decode, indptr, indices, last)
            return FlashInferMetadata(out_slots=info.out_slots, wrappers=tuple(self._decode))
        qo_indptr = _running_sum(info.q_lens_cpu)
        for wrapper, spec in zip(self._prefill, self.specs):
            self._guard.plan(id(wrapper), lambda wrapper=wrapper, spec=spec: wrapper.plan(
                qo_indptr, indptr, indices, last, num_qo_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim_qk=self.head_dim, page_size=1, causal=True, q_data_type=self.k_pool.dtype,
                kv_data_type=self.k_pool.dtype, **_spec_args(spec)))
        return FlashInferMetadata(out_slots=info.out_slots, wrappers=tuple(self._prefill))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert isinstance(meta, FlashInferMetadata)
        self.store_kv(k, v, layer, meta)
        pages = (self.k_pool[layer].unsqueeze(1), self.v_pool[layer].unsqueeze(1))  # [slots, 1, Hkv, D]
        return meta.wrappers[self.spec_index[layer]].run(q.contiguous(), pages)

    def init_graph_buffers(self, max_bs: int, token_table: torch.Tensor) -> None:
        self._graph = {
            "table": token_table,
            "out_slots": torch.zeros(max_bs, dtype=torch.int64, device=self.device),
            "indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            "indices": torch.zeros(max_bs * token_table.shape[1], dtype=torch.int32, device=self.device),
            "last": torch.ones(max_bs, dtype=torch.int32, device=self.device),
            "wrappers": {},
        }

    def prepare_for_capture(self, bs: int) -> FlashInferMetadata:
        g = self._graph
        wrappers = tuple(flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=g["indptr"][: bs + 1], paged_kv_indices_buffer=g["indices"],
            paged_kv_last_page_len_buffer=g["last"][:bs], backend=KERNELS) for _ in self.specs)
        g["wrappers"][bs] = wrappers
        # A graph-mode wrapper must be planned once before capture; the runner re-plans it for real rows.
        indptr = torch.arange(bs + 1, dtype=torch.int32).pin_memory()
        self._plan_decode(wrappers, indptr, g["indices"][:bs].zero_(), torch.ones(bs, dtype=torch.int32).pin_memory())
        return FlashInferMetadata(out_slots=g["out_slots"][:bs], wrappers=wrappers)

    def prepare_for_replay(self, bs: int, info: ForwardInfo) -> None:
        g = self._graph
        g["out_slots"][:bs].copy_(info.out_slots)
        indptr, indices, last = self._layout(info, indices=g["indices"], indptr_dev=g["indptr"])
        self._plan_decode(g["wrappers"][bs], indptr, indices, last)


def _spec_args(spec: LayerAttention) -> dict[str, Any]:
    """A layer spec as FlashInfer's plan arguments: `window_left` counts the keys left of the query (inclusive
    window: HF's `sliding_window` minus one; -1 for none), a soft-cap of 0 means none."""
    return {"sm_scale": spec.scale, "window_left": spec.window - 1 if spec.window else -1,
            "logits_soft_cap": spec.soft_cap or 0.0}


def _running_sum(lengths: list[int]) -> torch.Tensor:
    """`[0, l0, l0 + l1, ...]` as a pinned host int32 tensor (FlashInfer's indptr arguments)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out.pin_memory()
