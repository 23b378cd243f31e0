"""The KV pool: K and V tensors with one slot per token per layer. It only holds memory; `CacheManager`
decides which slots are free."""

from __future__ import annotations

import torch


class KVPool:
    """`k`, `v`: `[num_layers, num_slots + 1, n_kv_heads, head_dim]`.

    Slots `0 .. num_slots - 1` belong to requests (through `CacheManager`). One more, `scratch_slot`, belongs
    to nobody: padding rows of a CUDA-graph batch, and the graphs' capture, write their K/V there.
    """

    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        # Zeros, not empty: padded reads are masked, but NaN garbage would still leak through 0 * NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.scratch_slot = num_slots

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one token's K and V take across all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
