"""Attention backends over the paged KV pool, created by name (`--attention-backend`)."""

from __future__ import annotations

import torch

from kernels.attention.backend import AttentionBackend, AttentionMetadata, ForwardInfo
from kernels.attention.torch_paged import TorchPagedBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchPagedBackend}


def backend_names() -> tuple[str, ...]:
    """Names `create_backend` accepts."""
    return tuple(_BACKENDS)


def create_backend(name: str, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int) -> AttentionBackend:
    """The backend registered as `name`, over the given pools; ValueError names the choices otherwise."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {list(_BACKENDS)}")
    return _BACKENDS[name](k_pool, v_pool, num_heads)


__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardInfo", "TorchPagedBackend", "backend_names",
           "create_backend"]
