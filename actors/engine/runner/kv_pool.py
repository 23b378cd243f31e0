"""The KV pool: K and V tensors with one slot per token per layer. It only holds memory; `CacheManager`
decides which slots are free."""

from __future__ import annotations

import math
import mmap

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
        self.k = zeros(shape, dtype, device)
        self.v = self.k if latent else zeros(shape, dtype, device)
        self.num_slots = num_slots
        self.scratch_slot = num_slots

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        latent: bool = False) -> int:
        """Memory one token's K and V (or its latent) take across all layers."""
        return (1 if latent else 2) * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor. On the CPU its memory is an anonymous mapping, which the kernel hands out zeroed page by
    page as it is first written: `torch.zeros` writes every byte of a pool of gigabytes at start-up (seconds on a
    busy 2-core host) and holds all of it from the first second, slots never used included."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # private (a forked child gets its own copy on write); the tensor holds a reference to the mapping
    # (torch.frombuffer), so it lives as long as the tensor
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(memory, dtype=dtype).view(shape)
