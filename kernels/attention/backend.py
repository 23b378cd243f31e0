"""The attention backend contract: how one forward step's attention reads and writes the paged KV pool.

Each layer attends as its `LayerAttention` says (softmax scale, sliding window, logit soft-cap); every backend
honours all three, and with a window reads only the window's keys. The pool keeps every layer's KV for every
position (slots are per token, shared by all layers), so a sliding layer frees nothing early.

A step is a flat batch of `T` new tokens belonging to `B` requests. Request `b` brings `q_len[b]` new tokens
whose keys and values are appended after its `kv_len[b] - q_len[b]` cached ones, and each new token attends
causally to everything before it in its own request. Prefill (no prefix), decode (`q_len == 1`) and mixed
batches are all this one "extend" shape.

The KV pool holds token slots with page size 1: `k_pool[layer, slot]` is one token's keys `[n_kv_heads,
head_dim]`. A request's page table is the list of its slots in token order: one row of the engine's
request-to-token table, which `ForwardInfo` hands to the backend as it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import ringserve.kernels.attention.kv_store  # noqa: F401  (registers torch.ops.ringserve.store_kv)


@dataclass
class ForwardInfo:
    """One step's batch as every backend sees it; each backend builds its own metadata from this.

    `*_cpu` fields are host lists (shapes without a device sync); tensors live on the pool's device. The
    request-to-token table maps `(row, position)` to a pool slot; `req_rows[b]` is request `b`'s row, and
    its first `kv_lens_cpu[b]` entries (new tokens included) are valid.
    """

    q_lens_cpu: list[int]  # [B] new tokens per request
    kv_lens_cpu: list[int]  # [B] cached + new tokens per request
    req_rows: torch.Tensor  # [B] int64 rows of `token_table`
    token_table: torch.Tensor  # [R, max_len] int64 pool slot of each request's tokens
    out_slots: torch.Tensor  # [T] int64 slot where each new token's K/V is written
    kv_lens: torch.Tensor | None = None  # [B] int64 `kv_lens_cpu` on the device, when the caller has it


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends, as its model declares it; every backend honours all three fields."""

    scale: float  # softmax scale (1/sqrt(head_dim) unless the architecture says otherwise)
    window: int | None = None  # a query sees only the last `window` positions, its own included (HF's sliding_window)
    soft_cap: float | None = None  # logits become soft_cap * tanh(logits / soft_cap) before the softmax


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every layer, built once per step by `AttentionBackend.prepare`.

    Backends subclass this to add what their kernels need (masks, index maps, plan handles).
    """

    out_slots: torch.Tensor  # [T] int64 slot where each new token's K/V is written


class AttentionBackend(ABC):
    """Writes new K/V into the paged pool and computes attention for one layer at a time.

    Call `prepare` once per step (all index and mask tensors are built there, never per layer), then
    `forward` once per layer with that metadata.

    Implementations: `torch` (reference, CPU), `triton` (its own decode/extend kernels, index buffers built
    in `prepare`), `flashinfer` (prefill/decode wrappers planned over the table rows as a page-size-1 paged
    layout in `prepare`, `run()` in `forward`).

    CUDA graphs (decode only) use three more hooks, so the graph runner knows nothing of a backend:
    `init_graph_buffers` allocates static metadata buffers for the largest captured batch,
    `prepare_for_capture(bs)` returns metadata that reads only (views of) those buffers, filled with dummy
    values, and `prepare_for_replay(bs, info)` copies a real step's metadata into them before each replay.
    The runner pads a batch to a captured size with rows on the token table's scratch row (one key, output
    slot the pool's scratch slot), so padding rows touch no request's KV.
    """

    supports_cuda_graph: bool = False  # whether the three graph hooks are implemented

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int,
                 layers: Sequence[LayerAttention] | None = None) -> None:
        """`k_pool`/`v_pool`: `[num_layers, num_slots, n_kv_heads, head_dim]`, owned by the KV pool. `layers`: each
        layer's `LayerAttention` (default: every layer plain causal attention scaled by 1/sqrt(head_dim))."""
        self.k_pool = k_pool
        self.v_pool = v_pool
        self.num_heads = num_heads
        self.num_kv_heads = k_pool.shape[2]
        self.head_dim = k_pool.shape[3]
        self.layers: tuple[LayerAttention, ...] = (
            tuple(layers) if layers is not None else (LayerAttention(self.head_dim ** -0.5),) * k_pool.shape[0])
        if len(self.layers) != k_pool.shape[0]:
            raise ValueError(f"{len(self.layers)} layer specs for a pool of {k_pool.shape[0]} layers")

    @abstractmethod
    def prepare(self, info: ForwardInfo) -> AttentionMetadata:
        """Build the step's metadata; the table already holds the new tokens' slots."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Store `k`, `v` `[T, n_kv_heads, head_dim]` at `meta.out_slots` and attend with `q` `[T, n_heads,
        head_dim]`; returns `[T, n_heads, head_dim]`."""

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: int, meta: AttentionMetadata) -> None:
        """Write the step's new keys and values into their slots of `layer` (through the in-place op of
        kernels/attention/kv_store.py when compiled)."""
        latent = self.v_pool is self.k_pool  # latent attention: the values are the keys' leading part
        if torch.compiler.is_compiling():
            if latent:
                torch.ops.ringserve.store_latent(self.k_pool, layer, meta.out_slots, k)
            else:
                torch.ops.ringserve.store_kv(self.k_pool, self.v_pool, layer, meta.out_slots, k, v)
            return
        self.k_pool[layer].index_copy_(0, meta.out_slots, k)
        if not latent:
            self.v_pool[layer].index_copy_(0, meta.out_slots, v)

    def in_place_decode_inputs(self, meta: AttentionMetadata, layer: int) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, LayerAttention] | None:
        """Where every token of the step is a decode row read in place by the CPU paged kernel: its inputs for
        `layer` (token table, table rows `[T]`, KV lengths `[T]`, the layer's `LayerAttention`), for a kernel that
        runs a whole layer (kernels/cpu/decode_layer.py); None otherwise."""
        return None

    def compiles_decode(self) -> bool:
        """Whether a compiled CPU decode graph pays with this backend (its graph path reads the pool in place)."""
        return False

    def init_graph_buffers(self, max_bs: int, token_table: torch.Tensor) -> None:
        """Allocate static metadata buffers for decode batches of up to `max_bs` requests over `token_table`."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, bs: int) -> AttentionMetadata:
        """Metadata for a decode batch of `bs` rows that reads only the static buffers; the same object serves
        every replay of size `bs`. The runner fills the buffers (`prepare_for_replay`) before any forward."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, bs: int, info: ForwardInfo) -> None:
        """Copy a decode step's metadata (`info`, already padded to `bs` rows) into the static buffers."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
