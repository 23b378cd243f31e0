"""The KV pool: K and V tensors with one slot per token per layer. It only holds memory; `CacheManager`
decides which slots are free."""

from __future__ import annotations

import torch


class KVPool:
    """`k`, `v`: `[num_layers, num_slots + 1, n_kv_heads, head_dim]`; with `latent`, `v` is `k` itself (latent
    attention keeps one latent per token whose leading part serves as the values: models/mla.py).

    Slots `0 .. num_slots - 1` belong to requests (through `CacheManager`). One more, `scratch_slot`, belongs
    to nobody: padding rows of a CUDA-graph batch, and the graphs' capture, write their K/V there.
    """

    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device, latent: bool = False,
    ) -> None:
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        # Zeros, not empty: padded reads are masked, but NaN garbage would still leak through 0 * NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = self.k if latent else torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.scratch_slot = num_slots

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        latent: bool = False) -> int:
        """Memory one token's K and V (or its latent) take across all layers."""
        return (1 if latent else 2) * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
